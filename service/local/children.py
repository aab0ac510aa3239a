"""Child processes of ``trainq up``: each in its own session, stopped for certain, checked by pid.

Every child (Redis, the API, a worker) leads its own process group, so a signal reaches
everything it started and the terminal's Ctrl-C reaches only ``trainq up``, which then
stops the children in order: SIGTERM to the group, a bounded wait, SIGKILL. On Linux
``trainq up`` also makes itself a child subreaper, so a process whose parent died (a
torchrun whose worker was SIGKILLed) is re-parented to it rather than to init and is
still found, and killed, before ``trainq up`` exits. "Gone" is read from the process
table (``/proc``), not from exit statuses. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Child",
    "become_subreaper",
    "descendants",
    "is_alive",
    "kill_leftovers",
    "reap",
    "start_child",
]

_PROC = Path("/proc")
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants become our children (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) from /proc, or None when the process is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # comm may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2])


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    if _PROC.is_dir():
        st = _stat(pid)
        return st is not None and st[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (children, grandchildren, ...), read from /proc."""
    if not _PROC.is_dir():
        return []
    parents: dict[int, list[int]] = {}
    for entry in os.listdir(_PROC):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] not in ("Z", "X"):
                parents.setdefault(st[1], []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def reap() -> None:
    """Collect exited children, re-parented orphans included, so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass
class Child:
    """One started child: its Popen, its process group (= its pid) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def kind(self) -> str:
        """ "worker" for "worker-host-cpu": what the name says before its first dash."""
        return self.name.split("-", 1)[0]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 20) -> list[str]:
        try:
            return self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def group_alive(self) -> bool:
        """Any live process left in the child's group (zombies do not count)."""
        if _PROC.is_dir():
            for entry in os.listdir(_PROC):
                if entry.isdigit():
                    st = _stat(int(entry))
                    if st is not None and st[2] == self.pid and st[0] not in ("Z", "X"):
                        return True
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the group; after ``grace_s`` (or at once when 0) SIGKILL; wait for it."""
        if self.group_alive():
            self.signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            deadline = time.monotonic() + grace_s
            while self.group_alive() and time.monotonic() < deadline:
                if self.popen.poll() is None:
                    try:
                        self.popen.wait(0.05)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.05)
            if self.group_alive():
                self.signal(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


def start_child(
    name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path, *, stdin_pipe: bool = False
) -> Child:
    """Start ``argv`` (a list: never a shell) in a new session, output to ``log_dir/name.log``;
    with ``stdin_pipe`` its stdin is a pipe that ``Child.popen.stdin`` writes to."""
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Child(name, popen, log)


def kill_leftovers(timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every live descendant of this process; the pids still alive after it."""
    me = os.getpid()
    deadline = time.monotonic() + timeout_s
    left = descendants(me)
    while left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
        reap()
        left = [p for p in descendants(me) if is_alive(p)]
        if time.monotonic() > deadline:
            break
    return left
