"""worker.guard and worker.procs with real processes: the run dies with the worker's pipe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from worker.launch import build_guard_argv
from worker.procs import group_members, kill_group, wait_group_gone

# A stand-in for torchrun: a parent with a child of its own, both sleeping.
TREE = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def _start(code: str) -> subprocess.Popen[bytes]:
    argv = build_guard_argv(sys.executable, [sys.executable, "-c", code])
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )


def _cleanup(proc: subprocess.Popen[bytes]) -> None:
    kill_group(proc.pid)
    with proc:  # closes the pipes, reaps the guard
        pass


def _wait_members(pgid: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(group_members(pgid)) < n:
        assert time.monotonic() < deadline, group_members(pgid)
        time.sleep(0.02)


def test_pipe_eof_kills_the_whole_group() -> None:
    proc = _start(TREE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        _wait_members(proc.pid, 3)  # guard, the "torchrun", its child
        assert proc.stdin is not None
        proc.stdin.close()  # what the kernel does when the worker dies
        assert proc.wait(5) == -signal.SIGKILL
        assert wait_group_gone(proc.pid, 5), group_members(proc.pid)
    finally:
        _cleanup(proc)


def test_exit_status_passes_through_and_group_signals_reach_the_child() -> None:
    with _start("raise SystemExit(7)") as ok:
        assert ok.wait(10) == 7
    proc = _start(TREE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        _wait_members(proc.pid, 3)
        # SIGTERM to the group: the guard stays to report, the child dies of it.
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(5) == 128 + signal.SIGTERM
        # The grandchild (like an orphaned rank) also got SIGTERM; nothing is left.
        assert wait_group_gone(proc.pid, 5), group_members(proc.pid)
    finally:
        _cleanup(proc)


def test_kill_group_reaps_stragglers() -> None:
    proc = _start(TREE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        _wait_members(proc.pid, 3)
        assert kill_group(proc.pid, timeout=5)
        assert group_members(proc.pid) == []
    finally:
        _cleanup(proc)
