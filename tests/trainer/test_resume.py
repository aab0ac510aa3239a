"""Exact resume: a run killed (SIGKILL) or preempted (SIGTERM) mid-way and started again on its
run dir continues with exactly the losses of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tests.trainer import runs

# A long eval holds a run at a known step, so the test can signal it there without racing
# it to the end. Eval does not touch the training state (no grad, no RNG), so the training
# losses stay exactly those of the reference run, which evaluates differently.
PAUSE_AT_11 = {"every": 11, "steps": 200}  # eval at steps 11 and 20
PAUSE_AT_4 = {"every": 4, "steps": 30}  # eval at steps 4, 8, 12, ...


def test_ddp_killed_after_checkpoint_resumes_exactly(
    ddp_run: Path, data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    proc = runs.start(runs.config(eval=PAUSE_AT_11), run_dir, data_root, subprocess_env)
    done = run_dir / "checkpoints" / "step-10" / "DONE"
    runs.wait_for(done.exists, 90, "the step-10 checkpoint", proc)
    # A crash: SIGKILL every rank, then torchrun (which starts each rank in its own session).
    for pid in runs.descendants(proc.pid):
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert not (run_dir / "checkpoints" / "step-20").exists(), "run finished before the kill"
    killed_at = max(runs.losses(run_dir))
    assert 10 <= killed_at < 20

    code, out = runs.run(runs.config(), run_dir, data_root, subprocess_env)
    assert code == 0, out
    assert f"resumed from {run_dir / 'checkpoints' / 'step-10'} at step 10" in out
    resumed, straight = runs.losses(run_dir), runs.losses(ddp_run)
    # Steps 11..20 were recomputed after the resume; each must match bit for bit.
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


def test_ranks_exit_when_torchrun_is_killed(
    data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # A worker's hard stop kills torchrun's process group, which does not hold the ranks:
    # they must notice the launcher is gone and exit rather than train on as orphans.
    run_dir = tmp_path / "run"
    cfg = runs.config(steps=100_000, eval={"every": 0}, checkpoint={"every": 0})
    proc = runs.start(cfg, run_dir, data_root, subprocess_env)
    runs.wait_for(lambda: max(runs.losses(run_dir), default=0) >= 2, 90, "step 2", proc)
    ranks = runs.descendants(proc.pid)
    assert len(ranks) >= 2, ranks
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 15
    while any(runs.alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in ranks if runs.alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "ranks kept running after torchrun was killed"
    assert max(runs.losses(run_dir)) < 100_000
    assert not (run_dir / "checkpoints").exists()  # died without saving


def test_fsdp_sigterm_saves_and_rerun_resumes_exactly(
    fsdp_run: Path, data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    cfg = runs.fsdp_config(eval=PAUSE_AT_4, checkpoint={"every": 0})
    proc = runs.start(cfg, run_dir, data_root, subprocess_env)
    runs.wait_for(lambda: max(runs.losses(run_dir), default=0) >= 3, 90, "step 3", proc)
    # As a worker cancelling or a node draining does: SIGTERM to the whole process group.
    os.killpg(proc.pid, signal.SIGTERM)
    _, out = runs.finish(proc, timeout=60)
    saved = [ln for ln in out.splitlines() if "stopped on SIGTERM; checkpoint saved at step" in ln]
    assert len(saved) == 1, out
    assert "Warning" not in out, out  # no deprecated call printed by every rank
    step = int(saved[0].rsplit(" ", 1)[1])
    assert 3 <= step < 20, out
    assert (run_dir / "checkpoints" / f"step-{step}" / "DONE").is_file()
    assert max(runs.losses(run_dir)) == step  # it stopped at the step boundary it saved
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["reason"] == "preempted" and exit_info["step"] == step
    assert exit_info["exit_code"] == 0

    code, out = runs.run(runs.fsdp_config(), run_dir, data_root, subprocess_env)
    assert code == 0, out
    assert f"at step {step}" in out
    assert not (run_dir / "exit.json").exists()  # the earlier verdict was cleared
    resumed, straight = runs.losses(run_dir), runs.losses(fsdp_run)
    assert [resumed[s] for s in range(1, 21)] == [straight[s] for s in range(1, 21)]
