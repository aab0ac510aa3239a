"""Faults: a worker killed or shut down, a rank killed, a NaN loss, Redis restarted mid-run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.worker.conftest import (
    Wire,
    WorkerProc,
    assert_stopped_log,
    message,
    new_job,
    rank_pid,
    run_processes,
    tiny,
    wait_for,
)

LONG = tiny(steps=150, checkpoint={"every": 10, "keep": 2})


def _checkpointed(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("step-*/DONE"))


def _resumed(wire: Wire, job: str) -> list[str]:
    return [ln["line"] for ln in wire.log_lines(job) if ln["line"].startswith("resumed from")]


def test_sigkilled_worker_takes_its_run_along_and_a_retry_resumes_elsewhere(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    w1 = start_worker("w1")
    job = new_job()
    wire.send(message(job, train=LONG))
    run_dir = runs_root / job
    wait_for(lambda: _checkpointed(run_dir) and len(run_processes(run_dir)) >= 3, 90,
             "a checkpoint of the first attempt")  # fmt: skip
    os.kill(w1.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not run_processes(run_dir), 5, "every process of the run to die")
    # Nothing of the run is left writing: the checkpoint folder stays as it is.
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    wait_for(lambda: not wire.r.exists(wire.keys.heartbeat(job, 1)), 3 + 5,
             "the heartbeat to expire")  # fmt: skip
    assert time.monotonic() - t0 >= 1.0, "the heartbeat expires, it is not deleted"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert [d["phase"] for d in wire.lifecycle(job, 1)] == ["running"]

    # The service's reaper would now send attempt 2; any worker takes it and resumes.
    start_worker("w2")
    wire.send(message(job, attempt=2, train=LONG))
    done = wire.exited(job, 2)
    assert (done["reason"], done["exit_code"]) == (None, 0), done
    assert _resumed(wire, job), "attempt 2 resumes from attempt 1's checkpoint"
    first = min(m["step"] for m in wire.metrics(job, 2))
    assert first > 1 and max(m["step"] for m in wire.metrics(job, 2)) == 150
    assert wire.lifecycle(job, 2)[0]["worker"] == "w2"


def test_worker_sigterm_preempts_its_runs_and_deregisters(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    w = start_worker("w1")
    job = new_job()
    wire.send(message(job, train=tiny(steps=100_000, checkpoint={"every": 0, "keep": 1})))
    wait_for(lambda: len(wire.metrics(job)) >= 3, 90, "training to start")
    assert w.stop(signal.SIGTERM, timeout=40) == 0
    done = wire.exited(job, 1, timeout=5)
    assert done["reason"] == "preempted" and "w1 shut down" in done["message"]
    assert done["exit_code"] == -15, "the SIGTERM the worker sent, not torchrun's 1"
    assert_stopped_log(wire.log_lines(job), "worker w1 shut down")
    assert _checkpointed(runs_root / job), "ranks checkpoint on the way out"
    assert run_processes(runs_root / job) == []
    assert wire.worker_entry("w1") is None, "a clean shutdown leaves the registry"


@pytest.mark.parametrize("restarts", [1, 0])
def test_killed_rank(
    restarts: int, start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    start_worker("w1", max_restarts=restarts)
    job = new_job()
    wire.send(message(job, train=tiny(steps=150, checkpoint={"every": 10, "keep": 2})))
    run_dir = runs_root / job
    wait_for(lambda: _checkpointed(run_dir) and rank_pid(run_dir, 1), 90, "a checkpoint")
    pid = rank_pid(run_dir, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    done = wire.exited(job, 1)
    assert run_processes(run_dir) == []
    if restarts:
        # torchrun restarted the group, which resumed from the checkpoint and finished.
        assert (done["reason"], done["exit_code"]) == (None, 0), "\n".join(
            str(ln) for ln in wire.log_lines(job)[-60:]
        )
        assert _resumed(wire, job)
        assert max(m["step"] for m in wire.metrics(job)) == 150
    else:
        assert done["reason"] == "exit_code" and done["exit_code"] == 1
        assert "local rank 1 killed by signal 9 (SIGKILL)" in done["message"], done["message"]
        # The ranks' last lines, not torchrun's report of their failure.
        tail = done["message"].split("last lines:\n", 1)[1].splitlines()
        assert tail and all(ln.startswith("[rank") for ln in tail), tail


def test_nan_loss_from_a_poisoned_checkpoint(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    import torch

    from trainer.checkpoint import Progress, save_checkpoint
    from trainer.config import TrainConfig
    from trainer.model import GPT
    from trainer.train import build_optimizer

    start_worker("w1")
    job = new_job()
    cfg = TrainConfig.model_validate(tiny(steps=8, checkpoint={"every": 0, "keep": 1}))
    # A checkpoint at step 4 with NaN weights (written by the trainer's own code), as a
    # retry would find it: the resumed run's loss is NaN at once.
    gpt = GPT(cfg.model)
    gpt.init_weights()
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    save_checkpoint(runs_root / job, Progress(step=4, tokens_seen=0), gpt,
                    build_optimizer(gpt, cfg.optim), None, strategy="ddp", rank=0,
                    world_size=1, keep=1)  # fmt: skip
    wire.send(message(job, procs=1, train=cfg.model_dump(mode="json")))
    done = wire.exited(job, 1)
    assert done["reason"] == "nan_loss", done
    assert "step 5" in done["message"] and done["exit_code"] != 0
    assert any(ln["line"].startswith("resumed from") for ln in wire.log_lines(job))


@pytest.fixture()
def own_redis(tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """A private redis-server (the shared one must never be restarted), AOF on every write."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)

        def up() -> bool:
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0

        wait_for(up, 10, "redis-server to listen")
        return proc

    start.port = port  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)


def test_redis_restart_mid_run_loses_nothing(
    own_redis: Callable[[], subprocess.Popen[bytes]],
    worker_env: Callable[..., dict[str, str]],
    tmp_path: Path,
    runs_root: Path,
) -> None:
    server = own_redis()
    port = own_redis.port  # type: ignore[attr-defined]
    url, broker = f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/1"
    wire = Wire(url, broker)
    w = WorkerProc(worker_env(url, broker), tmp_path / "w.log", wire, "w1")
    try:
        job = new_job()
        steps = 300
        wire.send(message(job, train=tiny(steps=steps, checkpoint={"every": 0, "keep": 1})))
        wait_for(lambda: len(wire.metrics(job)) >= 5, 90, "training to start")
        server.terminate()
        assert server.wait(10) == 0
        time.sleep(2.0)  # the run goes on without Redis; the trainer and worker buffer
        assert len(run_processes(runs_root / job)) >= 3
        own_redis()
        done = wire.exited(job, 1)
        assert (done["reason"], done["exit_code"]) == (None, 0), done
        events = wire.events(job)
        for source in ("worker", "trainer"):
            # At least once: a batch whose reply was lost with the connection is sent again
            # (same seq, same data; the service dedupes by seq). None lost, none reordered.
            first: dict[int, dict[str, object]] = {}
            for e in events:
                if e.source == source:
                    assert first.setdefault(e.seq, e.data) == e.data
            assert list(first) == list(range(1, len(first) + 1)), f"{source}: lost/reordered"
        steps_seen = list(dict.fromkeys(m["step"] for m in wire.metrics(job)))
        assert steps_seen == list(range(1, steps + 1))
        assert events[-1].kind == "lifecycle" or any(
            e.kind == "lifecycle" and e.data["phase"] == "exited" for e in events
        )
    finally:
        w.stop(signal.SIGKILL)
        wire.r.close()
