"""A real worker runs real torchrun ranks: success, duplicates, cancel, deadline, bad specs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.worker.conftest import (
    Wire,
    WorkerProc,
    assert_stopped_log,
    message,
    new_job,
    proc_env,
    rank_pid,
    run_processes,
    tiny,
    wait_for,
    wrong_modes,
)
from trainer.config import TrainConfig
from trainer.data import write_shard
from trainer.paths import owner_key


def test_two_ranks_succeed_and_a_duplicate_delivery_does_nothing(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    w = start_worker("w1", slots=2)
    entry = wire.worker_entry("w1")
    assert entry is not None
    assert entry["queues"] == ["cpu"] and entry["slots"] == 2 and entry["running"] == []
    job = new_job()
    msg = message(job, train=tiny(steps=20))
    wire.send(msg)
    wire.send(msg)  # the same job + attempt again: both slots get one, one claim wins
    wait_for(lambda: job in (wire.worker_entry("w1") or {}).get("running", []), 30,
             "the registry to list the running job")  # fmt: skip
    done = wire.exited(job, 1)
    assert done == {"phase": "exited", "exit_code": 0, "reason": None, "message": "succeeded"}

    events = wire.events(job)
    worker_events = [e for e in events if e.source == "worker"]
    assert [e.seq for e in worker_events] == list(range(1, len(worker_events) + 1))
    phases = [e.data["phase"] for e in worker_events if e.kind == "lifecycle"]
    assert phases == ["running", "exited"], "a duplicate delivery must add nothing"
    running = worker_events[0].data
    assert running["worker"] == "w1" and running["host"] and isinstance(running["pid"], int)
    assert worker_events[-1].kind == "lifecycle"  # the log tail is flushed before the exit

    steps = [m["step"] for m in wire.metrics(job)]
    assert steps == list(range(1, 21))
    assert all(e.source == "trainer" for e in events if e.kind == "metric")

    lines = wire.log_lines(job)
    rank0 = [ln["line"] for ln in lines if ln["rank"] == 0 and ln["stream"] == "stdout"]
    assert any(ln.startswith("step 20/20") for ln in rank0), rank0[-5:]
    assert any(ln.startswith("done: 20 steps") for ln in rank0)
    assert not any("[rank" in ln["line"][:7] for ln in lines), "prefix must be parsed off"
    assert {ln["stream"] for ln in lines} <= {"stdout", "stderr"}

    run_dir = runs_root / job
    written = TrainConfig.model_validate(json.loads((run_dir / "config.json").read_text()))
    assert written == msg.train
    assert (run_dir / "metrics.jsonl").is_file()
    assert list((run_dir / "logs").rglob("stdout.log")), "torchrun's per-rank log files"
    assert (wire.r.get(wire.keys.claim(job, 1)) or b"").split()[0] == b"w1"
    assert not wire.r.exists(wire.keys.heartbeat(job, 1)), "a finished attempt drops its beat"
    # ... for an "exited" marker, so the reaper waits for the exit's ingestion (issue 22)
    assert wire.r.get(wire.keys.exited(job, 1)) == b"w1"
    assert wire.r.ttl(wire.keys.exited(job, 1)) > 3000
    wait_for(lambda: "duplicate delivery ignored" in w.log(), 10, "the duplicate to be seen")
    wait_for(lambda: (wire.worker_entry("w1") or {}).get("running") == [], 10,
             "the registry to clear the job")  # fmt: skip
    assert run_processes(run_dir) == []


def test_bad_data_paths_and_job_ids_are_spec_errors(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    start_worker("w1", gpus="0,1")
    cases = {
        "missing": "data.path 'missing': no such folder under the data root of worker w1",
        "../../etc": "must be a plain relative path under the data root",
        # an uploaded dataset's folder by path: only a frozen data.dataset reaches it
        f"datasets/{owner_key('alice')}/corp": "uploaded datasets are not reachable by a path",
    }
    jobs = {}
    for path in cases:
        job = new_job()
        jobs[path] = job
        wire.send(message(job, procs=1, train=tiny(data={"path": path})))
    bad_id = message("x", procs=1).model_copy(update={"job_id": ".."})
    wire.send(bad_id)
    for path, text in cases.items():
        done = wire.exited(jobs[path], 1, timeout=30)
        assert done["reason"] == "spec_error" and done["exit_code"] is None
        assert text in done["message"]
        # Found before launch: nothing ran, no run folder was made.
        assert [d["phase"] for d in wire.lifecycle(jobs[path])] == ["exited"]
        assert not (runs_root / jobs[path]).exists()
    # A frozen data.dataset whose folder is another owner's (a message forged or from an old
    # server): the worker checks the owner key against the job's owner.
    forged = new_job()
    data = {"dataset": "corp", "path": f"datasets/{owner_key('alice')}/corp"}
    wire.send(message(forged, procs=1, owner="bob", train=tiny(data=data)))
    done = wire.exited(forged, 1, timeout=30)
    assert done["reason"] == "spec_error" and "not reachable by a path" in done["message"]
    done = wire.exited("..", 1, timeout=30)
    assert done["reason"] == "spec_error" and "cannot name a run folder" in done["message"]
    job = new_job()
    wire.send(message(job, procs=3))
    done = wire.exited(job, 1, timeout=30)
    assert done["reason"] == "spec_error"
    assert done["message"] == "procs_per_node=3 but a slot of worker w1 has 2 GPU(s)"


def test_cancel_mid_run_stops_every_process(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    # GPU ids on a CPU host: the ranks only see CUDA_VISIBLE_DEVICES, which is the point.
    # Library variables pass by name: unknown ones of the same families stay behind.
    extra = {"TORCH_FOO": "1", "NCCL_BAR": "1", "NCCL_DEBUG": "WARN",
             "TORCH_SHOW_CPP_STACKTRACES": "1"}  # fmt: skip
    # The ranks' own Redis URL (a scoped ACL user in a deployment): another spelling here.
    rank_url = wire.url.replace("127.0.0.1", "localhost")
    start_worker("w1", gpus="3,5", env=extra, rank_redis_url=rank_url)
    job = new_job()
    wire.send(message(job, train=tiny(steps=100_000, checkpoint={"every": 0, "keep": 1})))
    wait_for(lambda: len(wire.metrics(job)) >= 3, 60, "training to start")
    run_dir = runs_root / job
    assert len(run_processes(run_dir)) >= 3  # torchrun and two ranks
    pid = rank_pid(run_dir, 1)
    assert pid is not None
    env = proc_env(pid)  # what user code actually sees: the allow-list, nothing more
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert (env["TRAINQ_JOB_ID"], env["TRAINQ_ATTEMPT"]) == (job, "1")
    assert env["TRAINQ_REDIS_URL"] == rank_url
    assert (env["NCCL_DEBUG"], env["TORCH_SHOW_CPP_STACKTRACES"]) == ("WARN", "1")
    assert "TORCH_FOO" not in env and "NCCL_BAR" not in env
    assert env["OMP_NUM_THREADS"] == "1"  # the test env's: a worker's own setting wins
    leaked = {k for k in env if k.startswith("TRAINQ_")} - {
        "TRAINQ_REDIS_URL", "TRAINQ_REDIS_PREFIX", "TRAINQ_JOB_ID", "TRAINQ_ATTEMPT",
        "TRAINQ_FENCE",
    }  # fmt: skip
    assert leaked == set(), "the broker URL and worker settings must not reach ranks"
    t0 = time.monotonic()
    wire.cancel(job)
    done = wire.exited(job, 1, timeout=30)
    assert done["reason"] == "cancelled" and done["message"] == "cancelled by the user"
    assert done["exit_code"] == -15, "the SIGTERM the worker sent, not torchrun's 1"
    assert time.monotonic() - t0 < 15, "SIGTERM should have been enough"
    assert run_processes(run_dir) == []
    # SIGTERM (not SIGKILL) reached the ranks: they saved a checkpoint on the way out.
    assert list((run_dir / "checkpoints").glob("step-*/DONE"))
    assert not wire.r.exists(wire.keys.heartbeat(job, 1))
    assert_stopped_log(wire.log_lines(job), "cancelled by the user")


def test_a_user_cancel_during_a_preemption_is_a_cancel(
    start_worker: Callable[..., WorkerProc], wire: Wire
) -> None:
    """The admitter asks the run to yield, and the user cancels it while it stops: the job
    is the user's cancel, and its log never says preempted."""
    w = start_worker("w1")
    job = new_job()
    wire.send(message(job, train=tiny(steps=100_000, checkpoint={"every": 0, "keep": 1})))
    wait_for(lambda: len(wire.metrics(job)) >= 3, 60, "training to start")
    wire.r.set(wire.keys.preempt(job, 1), "preempted by job jhigh (priority 5) on queue cpu")
    wire.r.publish(wire.keys.cancel_channel(), job)
    time.sleep(0.3)  # the watch has read the preempt key; the ranks take longer to stop
    wire.cancel(job)
    done = wire.exited(job, 1, timeout=30)
    assert "cancelled while it yielded" in w.log(), "the stop began as a preemption"
    assert (done["reason"], done["message"]) == ("cancelled", "cancelled by the user"), done
    lines = wire.log_lines(job)
    assert not [ln for ln in lines if "preempt" in ln["line"]], lines[-5:]
    assert_stopped_log(lines, "cancelled by the user")


def test_cancel_flag_set_before_launch(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    start_worker("w1")
    job = new_job()
    wire.r.set(wire.keys.cancel(job), "1")  # no publish: the key alone is the truth
    wire.send(message(job))
    done = wire.exited(job, 1, timeout=30)
    assert (done["reason"], done["exit_code"]) == ("cancelled", None)
    assert not (runs_root / job).exists()


def test_deadline_ends_the_run_with_timeout(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    start_worker("w1")
    job = new_job()
    wire.send(message(job, max_runtime_s=8, train=tiny(steps=100_000)))
    done = wire.exited(job, 1, timeout=60)
    assert done["reason"] == "timeout" and "max_runtime_s=8" in done["message"]
    assert done["exit_code"] == -15
    assert run_processes(runs_root / job) == []
    running_at = next(e.ts for e in wire.events(job) if e.kind == "lifecycle")
    exited_at = [e.ts for e in wire.events(job) if e.kind == "lifecycle"][-1]
    assert 8 <= exited_at - running_at < 8 + 15 + 5


def test_token_ids_past_the_model_vocab_are_a_spec_error_before_any_process_group(
    start_worker: Callable[..., WorkerProc], wire: Wire
) -> None:
    """Not torchrun's ChildFailedError around an IndexError from the first forward pass."""
    start_worker("w1")
    job = new_job()
    wire.send(message(job, train=tiny(data={"path": "gpt2"})))
    done = wire.exited(job, 1)
    assert done["reason"] == "spec_error", done
    assert done["message"] == (
        "dataset 'gpt2' has vocab 50257 (max token id 50256) but model.vocab_size is 256; "
        "set model.vocab_size to at least 50257 (rank 0)"
    )
    lines = [ln["line"] for ln in wire.log_lines(job)]
    # No rank built a model ("N parameters, ddp x2"), none failed inside torch.
    assert not any(
        "parameters," in ln or "IndexError" in ln or "ChildFailedError" in ln for ln in lines
    ), lines


def test_a_crashing_rank_reports_its_own_error_line(
    start_worker: Callable[..., WorkerProc], wire: Wire
) -> None:
    """The attempt's message is the trainer's last error line, and the log has neither
    torchrun's OMP_NUM_THREADS banner (the worker sets it; here the worker itself has none)
    nor its ChildFailedError box after the rank's traceback."""
    start_worker("w1", env={"OMP_NUM_THREADS": None})
    job = new_job()
    wire.send(message(job, train=tiny(data={"path": "stale"})))
    done = wire.exited(job, 1)
    assert (done["reason"], done["exit_code"]) == ("exit_code", 1), done
    assert re.fullmatch(
        r"IndexError: index out of range in self \(rank [01], step 1\)", done["message"]
    ), done["message"]
    lines = wire.log_lines(job)
    text = [ln["line"] for ln in lines]
    assert any(t.endswith("IndexError: index out of range in self") for t in text), text
    # The rank's own traceback reaches the user; the worker stopped nothing, so says nothing.
    assert any(ln["rank"] is not None and "Traceback" in ln["line"] for ln in lines), lines
    assert not any(t.startswith("trainq:") for t in text), text
    assert not any("OMP_NUM_THREADS" in t or "ChildFailedError" in t for t in text), text
    agent = [ln["line"] for ln in lines if ln["rank"] is None]
    # torchrun's own account is one line per failed rank (the rank it stopped with SIGTERM
    # may come after the one that crashed, in either order).
    assert any(
        re.fullmatch(
            r"trainer\.torchrun: rank [01] \(local_rank: [01]\) failed with exitcode: 1", line
        )
        for line in agent
    ), agent[-8:]


def test_run_folder_is_group_readable_at_most(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    """A worker started with umask 0 still leaves folders 0750 and files 0640: its own
    config.json, torchrun's logs, the ranks' metrics, TensorBoard files and checkpoints
    (through their temporary folder, FSDP's DCP shards)."""
    start_worker("w1", umask=0)
    job = new_job()
    train = tiny(strategy="fsdp", steps=4, checkpoint={"every": 2, "keep": 2})
    wire.send(message(job, train=train))
    done = wire.exited(job, 1)
    assert done["reason"] is None, done
    run_dir = runs_root / job
    files = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    assert {"config.json", "metrics.jsonl", "checkpoints/step-2/DONE",
            "checkpoints/step-4/dcp/__1_0.distcp"} <= files, files  # fmt: skip
    assert any(f.startswith("logs/") and f.endswith("/stderr.log") for f in files), files
    assert any(f.startswith("tb/events.") for f in files), files
    assert wrong_modes(run_dir) == {}


def test_a_shard_that_is_a_link_fails_the_run_and_is_never_read(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path, data_root: Path
) -> None:
    """A folder inside the data root whose ``train_*.bin`` links to a file outside (a real
    shard, then a secret): the trainer refuses it by name, trains on nothing, and the
    message quotes no byte of the target and no absolute path (issue 22)."""
    start_worker("w1")
    outside = runs_root.parent / f"outside-{new_job()}"
    write_shard(outside / "train_000.bin", np.arange(40_000) % 256)
    secret = outside / "secret.txt"
    secret.write_bytes(b"ALICE-SECRET-KEY=hunter2\n" * 100)
    for target in (outside / "train_000.bin", secret):
        folder = data_root / f"linked-{new_job()}"
        folder.mkdir()
        write_shard(folder / "val_000.bin", np.arange(4_000) % 256)
        (folder / "train_000.bin").symlink_to(target)
        job = new_job()
        wire.send(message(job, procs=1, train=tiny(data={"path": folder.name})))
        done = wire.exited(job, 1, timeout=90)
        assert done["reason"] == "spec_error", done
        assert f"{folder.name}: train_000.bin is a symbolic link" in done["message"]
        for leak in (str(data_root), str(outside), "ALICE", "1128877121"):
            assert leak not in done["message"]
        assert wire.metrics(job) == []  # never trained on it
