"""The process table: who is still in a run's process group, and making sure nobody is.

Read from /proc (Linux), because a run counts as gone only when the table says so, not
when torchrun's exit status does: ranks re-parented after a torchrun crash keep their
process group, so the group is the handle on every process of the run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["group_members", "kill_group", "signal_group", "wait_group_gone"]

_PROC = Path("/proc")


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, pgid) of a process, or None if it is gone."""
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group; zombies do not count (they run nothing)."""
    members = []
    for entry in os.listdir(_PROC):
        if not entry.isdigit():
            continue
        st = _stat(entry)
        if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the group; False if it has no member left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def kill_group(pgid: int, timeout: float = 10.0) -> bool:
    """SIGKILL whatever is left of the group and wait until the table shows none of it."""
    while True:
        if not group_members(pgid):
            return True
        signal_group(pgid, signal.SIGKILL)
        if wait_group_gone(pgid, min(timeout, 1.0)):
            return True
        timeout -= 1.0
        if timeout <= 0:
            return False
