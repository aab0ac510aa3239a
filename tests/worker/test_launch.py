"""worker.launch: the torchrun argv list and the allow-listed environment."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from worker.launch import (
    ENV_LIBRARY,
    build_env,
    build_guard_argv,
    build_torchrun_argv,
    omp_threads,
    safe_job_id,
)
from worker.supervise import write_run_config


def _argv(**kw: object) -> list[str]:
    args: dict[str, object] = dict(
        nnodes=1,
        nproc_per_node=2,
        max_restarts=1,
        config=Path("/runs/j1/config.json"),
        run_dir=Path("/runs/j1"),
        data_root=Path("/data"),
        log_dir=Path("/runs/j1/logs"),
    )
    args.update(kw)
    return build_torchrun_argv("/py", **args)


def test_single_node_is_standalone_and_runs_the_trainer_module() -> None:
    argv = _argv()
    assert argv[:3] == ["/py", "-m", "trainer.torchrun"]
    assert "--standalone" in argv
    assert "--nnodes=1" in argv and "--nproc-per-node=2" in argv and "--max-restarts=1" in argv
    assert not any(a.startswith("--rdzv") for a in argv)
    i = argv.index("trainer")
    assert argv[i - 1] == "-m"
    assert argv[i + 1 :] == [
        "--config", "/runs/j1/config.json", "--run-dir", "/runs/j1", "--data-root", "/data",
    ]  # fmt: skip


def test_node_i_of_a_gang_joins_a_static_rendezvous_as_node_rank_i() -> None:
    for node in (0, 1, 2):
        argv = _argv(nnodes=3, node_rank=node, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job-7-1")
        assert "--standalone" not in argv
        assert "--nnodes=3" in argv and "--nproc-per-node=2" in argv
        # static: torchrun keeps --node-rank (c10d would ignore it), so node 0 hosts rank 0
        assert "--rdzv-backend=static" in argv and f"--node-rank={node}" in argv
        assert "--rdzv-endpoint=10.0.0.1:29400" in argv and "--rdzv-id=job-7-1" in argv
        assert argv.index("--rdzv-backend=static") < argv.index("trainer")
    with pytest.raises(ValueError, match="rendezvous"):
        _argv(nnodes=2)
    with pytest.raises(ValueError, match="node rank 2"):
        _argv(nnodes=2, node_rank=2, rdzv_endpoint="h:1", rdzv_id="x")


def test_spec_strings_stay_single_argv_items() -> None:
    # A hostile-looking path is one item, never split or interpreted.
    weird = Path("/runs/a b; rm -rf ~/$(x)")
    argv = _argv(run_dir=weird)
    assert str(weird) in argv
    guard = build_guard_argv("/py", argv)
    assert guard[:3] == ["/py", "-I", "-S"] and guard[4] == "--" and guard[5:] == argv
    assert Path(guard[3]).name == "guard.py" and Path(guard[3]).is_file()


def test_env_is_allow_listed() -> None:
    parent = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/repo",
        "HOME": "/home/u",
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "INFO",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TRAINQ_BROKER_URL": "redis://secret@broker/1",
        "AWS_SECRET_ACCESS_KEY": "x",
        "TRAINQ_DATABASE_URL": "postgresql://u:p@db/x",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        # Unknown names of the families: a prefix would have passed them.
        "TORCH_FOO": "secret-torch",
        "NCCL_BAR": "secret-nccl",
        "CUDA_BAZ": "secret-cuda",
    }
    env = build_env(parent, gpus=(2, 3), redis_url="redis://r/0", redis_prefix="tq",
                    job_id="j1", attempt=3, threads=4)  # fmt: skip
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["TRAINQ_REDIS_URL"] == "redis://r/0" and env["TRAINQ_REDIS_PREFIX"] == "tq"
    assert env["TRAINQ_JOB_ID"] == "j1" and env["TRAINQ_ATTEMPT"] == "3"
    assert env["NCCL_DEBUG"] == "INFO" and env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for k in ("PATH", "PYTHONPATH", "HOME", "LANG", "OMP_NUM_THREADS"):
        assert env[k] == parent[k]  # OMP_NUM_THREADS set on the worker wins over threads
    assert "TRAINQ_BROKER_URL" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert "TRAINQ_DATABASE_URL" not in env
    assert {"TORCH_FOO", "NCCL_BAR", "CUDA_BAZ"}.isdisjoint(env)
    assert not any("secret" in v or "u:p@" in v for v in env.values())
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarts need a fresh store
    assert "CUDA_VISIBLE_DEVICES" not in ENV_LIBRARY and len(set(ENV_LIBRARY)) == len(ENV_LIBRARY)


def test_cpu_slot_hides_all_gpus() -> None:
    env = build_env({"CUDA_VISIBLE_DEVICES": "0"}, gpus=None, redis_url="r", redis_prefix="p",
                    job_id="j", attempt=1, threads=1)  # fmt: skip
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_ranks_get_their_share_of_the_slots_cpus() -> None:
    """OMP_NUM_THREADS is always set (torchrun prints a banner into every run's log when it
    is not): the slot's share of the CPUs, split among its ranks, and at least one."""
    assert [omp_threads(32, 2, 4), omp_threads(32, 1, 8), omp_threads(2, 1, 2)] == [4, 4, 1]
    assert [omp_threads(2, 4, 2), omp_threads(3, 1, 2), omp_threads(1, 1, 1)] == [1, 1, 1]
    env = build_env({}, gpus=None, redis_url="r", redis_prefix="p", job_id="j", attempt=1,
                    threads=omp_threads(32, 2, 4))  # fmt: skip
    assert env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize(
    ("job_id", "ok"),
    [("j1", True), ("01HZX-abc_1.2", True), ("..", False), ("a/b", False), ("a..b", False),
     (".hidden", False), ("", False), ("x" * 65, False), ("a\nb", False)],
)  # fmt: skip
def test_job_ids_that_cannot_leave_the_runs_root(job_id: str, ok: bool) -> None:
    assert safe_job_id(job_id) is ok


def test_gpus_are_dealt_to_slots_in_equal_contiguous_shares() -> None:
    from worker.context import split_gpus

    assert split_gpus(None, 2) == [None, None]
    assert split_gpus([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert split_gpus([4, 6], 1) == [(4, 6)]
    with pytest.raises(ValueError, match="cannot be shared equally"):
        split_gpus([0, 1, 2], 2)
    with pytest.raises(ValueError, match="twice"):
        split_gpus([0, 0], 1)


def test_nodes_writing_the_run_config_at_once_never_collide(tmp_path: Path) -> None:
    """Every node of an attempt writes RUN_DIR/config.json into the shared run dir; one
    node's rename must never take another's temporary file (it did: a node failed 'lost'
    with FileNotFoundError when two nodes of one job started on the same host together)."""
    train = {"steps": 5, "model": {"n_layer": 1}}
    errors: list[BaseException] = []

    def node() -> None:
        try:
            for _ in range(300):
                write_run_config(tmp_path, train)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert json.loads((tmp_path / "config.json").read_text()) == train
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_the_advertised_interface_goes_to_gloo_and_nccl_unless_the_worker_names_one() -> None:
    kw: dict[str, Any] = dict(gpus=None, redis_url="r", redis_prefix="p", job_id="j", attempt=1,
                              threads=1)  # fmt: skip
    env = build_env({}, ifname="eth1", **kw)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("eth1", "eth1")
    assert "GLOO_SOCKET_IFNAME" not in build_env({}, **kw), "one node: no interface named"
    named = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    mine = build_env(named, ifname="eth1", **kw)
    assert (mine["GLOO_SOCKET_IFNAME"], mine["NCCL_SOCKET_IFNAME"]) == ("ib0", "ib0")


def test_tracker_credentials_reach_only_runs_that_track_there(tmp_path: Path) -> None:
    from trainer.config import load_config
    from worker.launch import owner_secrets, trackers_of

    parent = {"WANDB_API_KEY": "worker-key", "MLFLOW_TRACKING_TOKEN": "worker-token"}
    base = {"gpus": None, "redis_url": "r", "redis_prefix": "p", "job_id": "j", "attempt": 1,
            "threads": 1}  # fmt: skip
    quiet = build_env(parent, **base, trackers=trackers_of(load_config({})))
    assert "WANDB_API_KEY" not in quiet and "MLFLOW_TRACKING_TOKEN" not in quiet
    assert "TRAINQ_TRACKING_ALLOW_PRIVATE" not in quiet
    wandb = load_config({"tracking": {"wandb": {"project": "p"}}})
    assert trackers_of(wandb) == ["wandb"]
    env = build_env(parent, **base, trackers=["wandb"], tracking_allow_private=True)
    assert env["WANDB_API_KEY"] == "worker-key" and "MLFLOW_TRACKING_TOKEN" not in env
    assert env["TRAINQ_TRACKING_ALLOW_PRIVATE"] == "1"

    # An owner's own key, set by an admin on the worker host, wins for that owner's runs.
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "WANDB_API_KEY").write_text("alice-key\n")
    (tmp_path / "alice" / "MLFLOW_TRACKING_TOKEN").symlink_to(tmp_path / "alice" / "WANDB_API_KEY")
    found = owner_secrets(tmp_path, "alice", ["wandb", "mlflow"])
    assert found == {"WANDB_API_KEY": "alice-key"}  # the link is not followed
    env = build_env(parent, **base, trackers=["wandb"], secrets=found)
    assert env["WANDB_API_KEY"] == "alice-key"
    assert owner_secrets(tmp_path, "bob", ["wandb"]) == {}
    assert owner_secrets(tmp_path, "../alice", ["wandb"]) == {}
    assert owner_secrets(None, "alice", ["wandb"]) == {}
