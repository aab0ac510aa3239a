"""A runs root that fills up: the job that filled it ends ``disk_full`` with no partial
checkpoint left, the next tenant's job is requeued (not lost, not failed), and the worker
stays alive for the job after (a real worker, torchrun and a small tmpfs as the runs root)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.smallfs import fill, small_fs
from tests.worker.conftest import Wire, WorkerProc, message, new_job, tiny

pytestmark = pytest.mark.timeout(300)


def test_a_full_runs_root_fails_its_filler_and_spares_the_next_job(
    start_worker: Callable[..., WorkerProc], wire: Wire, tmp_path: Path
) -> None:
    with small_fs(tmp_path / "small-runs", 6) as runs:
        worker = start_worker(runs_root=runs)
        # The spec: a checkpoint every 2 steps, all kept (~0.45 MiB each here).
        greedy = new_job()
        train = tiny(steps=40, checkpoint={"every": 2, "keep": 1000, "hf": "none"})
        wire.send(message(greedy, procs=1, train=train))
        out = wire.exited(greedy, 1, timeout=180)
        assert out["reason"] == "disk_full", out
        assert "no room for checkpoint" in out["message"], out
        assert "Traceback" not in out["message"]
        kept = list((runs / greedy / "checkpoints").glob("step-*/DONE"))
        assert kept, "it kept what fitted"
        assert not list(runs.rglob("tmp-step-*")), "no partial checkpoint is left"

        # The disk is now full to the last byte (someone else's file): the next tenant's
        # job cannot even get its run folder. It goes back to the queue, not lost.
        filler = fill(runs)
        innocent = new_job()
        wire.send(message(innocent, procs=1))
        out = wire.exited(innocent, 1, timeout=60)
        assert out["reason"] == "no_worker" and "runs root is full" in out["message"], out
        assert not list((runs / innocent).glob(".config.json.*")), "no half-written file"
        assert worker.proc.poll() is None and wire.worker_entry(worker.name) is not None

        # Room again: the same worker runs the next job to its end.
        filler.unlink()
        shutil.rmtree(runs / greedy)
        after = new_job()
        small = tiny(steps=6, checkpoint={"every": 3, "keep": 1})
        wire.send(message(after, procs=1, train=small))
        out = wire.exited(after, 1, timeout=120)
        assert out["exit_code"] == 0 and out["reason"] is None, out
