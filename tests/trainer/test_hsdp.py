"""HSDP: FSDP2 over a (replicate, shard) mesh, on 2 nodes x 2 ranks (CPU, gloo).

Each node is its own torchrun, launched with the worker's own argv (worker.launch: a static
rendezvous on 127.0.0.1, ``--nnodes 2 --node-rank N``), so the trainer sees what a gang
launch gives it: LOCAL_WORLD_SIZE 2 of WORLD_SIZE 4, and ``fsdp.replicate: auto`` makes a
2 x 2 mesh. Checkpoints written under one layout resume under another (HSDP -> FSDP -> DDP
-> FSDP, the world size changing on the way), with the losses of a straight run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.cli.plan_view import plan_text
from tests.e2e.system import free_port
from tests.trainer import runs
from trainer.config import ConfigError, load_config
from trainer.mesh import layout
from trainer.plan import plan
from worker.launch import build_torchrun_argv

# 4 ranks x 2 samples: the 8 samples a step of the reference runs (conftest.py).
HSDP = runs.config(strategy="fsdp", batch={"micro_batch_size": 2, "grad_accum_steps": 1})


def _two_nodes(
    cfg: dict[str, Any], run_dir: Path, data_root: Path, env: dict[str, str]
) -> list[str]:
    """Run ``cfg`` as 2 nodes x 2 ranks (two torchruns); both must succeed; their output."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / f"{run_dir.name}.json"
    cfg_path.write_text(json.dumps({**cfg, "checkpoint": {"hf": "none", **cfg["checkpoint"]}}))
    endpoint, rdzv = f"127.0.0.1:{free_port()}", run_dir.name
    procs = []
    for node in (0, 1):
        argv = build_torchrun_argv(
            sys.executable, nnodes=2, nproc_per_node=2, max_restarts=0, config=cfg_path,
            run_dir=run_dir, data_root=data_root, log_dir=run_dir.parent / f"logs-{node}",
            rdzv_endpoint=endpoint, rdzv_id=rdzv, node_rank=node,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                argv,
                env=env,
                cwd=runs.REPO,
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    outs = [runs.finish(p, timeout=180) for p in procs]
    for code, _ in outs:
        assert code == 0, "\n".join(o for _, o in outs)
    return [out for _, out in outs]


def _resume_from(run_dir: Path, source: Path, step: int) -> Path:
    """A fresh run folder that holds only ``source``'s checkpoint of ``step``."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        source / "checkpoints" / f"step-{step}", run_dir / "checkpoints" / f"step-{step}"
    )
    return run_dir


def _series(run_dir: Path, first: int = 1) -> list[float]:
    got = runs.losses(run_dir)
    assert sorted(got) == list(range(first, 21)), f"steps logged: {sorted(got)}"
    return [got[s] for s in range(first, 21)]


@pytest.fixture(scope="module")
def hsdp_run(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> tuple[Path, list[str]]:
    run_dir = tmp_path_factory.mktemp("hsdp") / "hsdp"
    return run_dir, _two_nodes(HSDP, run_dir, data_root, subprocess_env)


def test_hsdp_two_nodes_match_fsdp_and_one_process(
    hsdp_run: tuple[Path, list[str]], fsdp_run: Path, single_run: Path
) -> None:
    run_dir, outs = hsdp_run
    assert "layout: hsdp: 2 replicas x 2 shards" in outs[0], outs[0]
    hsdp, fsdp, single = _series(run_dir), _series(fsdp_run), _series(single_run)
    assert max(abs(a - b) for a, b in zip(hsdp, fsdp, strict=True)) < 1e-4, (hsdp, fsdp)
    assert max(abs(a - b) for a, b in zip(hsdp, single, strict=True)) < 1e-4, (hsdp, single)
    meta = json.loads((run_dir / "checkpoints" / "step-20" / "meta.json").read_text())
    assert (meta["strategy"], meta["world_size"]) == ("fsdp", 4)
    assert (run_dir / "checkpoints" / "step-20" / "dcp").is_dir()


def test_resume_across_hsdp_fsdp_ddp(
    hsdp_run: tuple[Path, list[str]],
    single_run: Path,
    data_root: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    """HSDP 2x2 (DCP at step 10) -> FSDP x2 to step 15 (DCP resharded onto a 1-D mesh) ->
    DDP x2 to step 18 (whole tensors out of DCP, saved as model.pt) -> FSDP x2 to 20 (shards
    cut from model.pt): every leg's losses are the straight one-process run's."""
    single = dict(zip(range(1, 21), _series(single_run), strict=True))
    fsdp = _resume_from(tmp_path / "fsdp", hsdp_run[0], 10)
    cfg = runs.fsdp_config(checkpoint={"every": 5, "keep": 5})  # 15 and 20
    code, out = runs.run(cfg, fsdp, data_root, subprocess_env, nproc=2)
    assert code == 0 and "at step 10" in out, out

    ddp = _resume_from(tmp_path / "ddp", fsdp, 15)
    cfg = runs.config(checkpoint={"every": 3, "keep": 5})  # 18 and 20
    code, out = runs.run(cfg, ddp, data_root, subprocess_env, nproc=2)
    assert code == 0 and "at step 15" in out, out
    assert (ddp / "checkpoints" / "step-18" / "model.pt").is_file()

    back = _resume_from(tmp_path / "back", ddp, 18)
    code, out = runs.run(runs.fsdp_config(), back, data_root, subprocess_env, nproc=2)
    assert code == 0 and "at step 18" in out, out

    for leg, first in ((fsdp, 11), (ddp, 16), (back, 19)):
        got = _series(leg, first)
        want = [single[s] for s in range(first, 21)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (leg, got, want)


def test_replicate_must_divide_the_world() -> None:
    cfg = load_config(runs.config(strategy="fsdp", fsdp={"replicate": 3}))
    with pytest.raises(ConfigError, match=r"fsdp.replicate \(3\) must divide the world size"):
        layout(cfg, 4, 2)
    auto = load_config(runs.config(strategy="fsdp"))
    assert layout(auto, 8, 2).mesh == (2, 4)  # auto: one replica per node
    assert layout(auto, 8, 1).mesh is None and layout(auto, 8, 1).strategy == "fsdp"
    two = load_config(runs.config(strategy="fsdp", fsdp={"replicate": 2}))
    assert layout(two, 4, 1).mesh == (2, 2)  # a number works on one node too
    with pytest.raises(ConfigError, match=r"fsdp options .* need strategy fsdp"):
        load_config(runs.config(fsdp={"replicate": 2}))
    with pytest.raises(ConfigError, match=r"fsdp\.replicate"):
        load_config(runs.config(strategy="fsdp", fsdp={"replicate": "two"}))


def test_the_plan_shards_over_the_shard_dimension_only() -> None:
    """2 nodes x 2 ranks: HSDP holds what FSDP over one node's 2 ranks holds per device
    (its shard group), twice FSDP over all 4; the plan says which layout it counted."""

    def fsdp(**fsdp: Any) -> dict[str, Any]:
        model = {"n_layer": 4, "n_head": 2, "d_model": 64, "seq_len": 32, "vocab_size": 256}
        return load_config(runs.config(strategy="fsdp", model=model, fsdp=fsdp))

    hsdp = plan(fsdp(), procs_per_node=2, nodes=2)
    flat = plan(fsdp(replicate=1), procs_per_node=2, nodes=2)
    one_node = plan(fsdp(), procs_per_node=2, nodes=1)
    assert (hsdp["layout"]["strategy"], hsdp["layout"]["replicate"], hsdp["layout"]["shard"]) == (
        "hsdp", 2, 2,
    )  # fmt: skip
    assert (flat["layout"]["strategy"], flat["layout"]["shard"]) == ("fsdp", 4)
    assert hsdp["memory"]["device"] == one_node["memory"]["device"]
    dev, flat_dev = hsdp["memory"]["device"], flat["memory"]["device"]
    total = hsdp["parameters"]["total"]
    assert dev["weights"] == 4 * -(-total // 2) and flat_dev["weights"] == 4 * -(-total // 4)
    assert dev["optimizer"] > flat_dev["optimizer"] and dev["total"] > flat_dev["total"]
    assert dev["activations"] == flat_dev["activations"]  # the same micro-batch per rank
    assert hsdp["tokens_per_step"] == flat["tokens_per_step"]
    text = plan_text(hsdp)
    assert "layout:    hsdp: 2 replicas x 2 shards" in text, text
    assert "layout:    fsdp: parameters sharded over 4 rank(s)" in plan_text(flat)
