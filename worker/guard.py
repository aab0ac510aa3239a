"""The guard: a tiny process between the worker and torchrun, so a dead worker kills its run.

torchrun runs in its own session (the worker must be able to signal the whole run as one
process group), so it would outlive a worker killed by SIGKILL. The guard leads that group,
starts torchrun as its child, and holds the read end of a pipe whose write end only the
worker holds. When the pipe reaches EOF — the worker closed it or died — the guard SIGKILLs
the whole group, itself included. Otherwise it exits with torchrun's exit status.

It sits on the submit -> exec path, so it starts lean: run with ``python -I -S``, it imports
only os, select and the C signal module, spawns with posix_spawn and waits with a pidfd.
Linux only (pidfd_open, Linux 5.3+).

Usage: ``python -I -S guard.py -- ARGV...``
"""

from __future__ import annotations

import _signal  # the C module behind `signal`; `signal` itself pulls in enum (~15 ms)
import os
import select
import sys


def _ignore(signum: int, frame: object) -> None:
    """A signal to the group is for torchrun and the ranks; the guard stays to report."""


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        os.write(2, b"guard: nothing to run\n")
        return 2
    # A handler (not SIG_IGN): caught signals are reset to the default in the spawned child.
    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
        _signal.signal(sig, _ignore)
    pid = os.posix_spawnp(
        argv[0],
        argv,
        os.environ,
        file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
    )
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(0, select.POLLIN)  # POLLHUP is always reported
    poller.register(pidfd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == pidfd:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                return 128 - code if code < 0 else code
            try:
                data = os.read(0, 4096)
            except OSError:
                data = b""
            if not data:  # EOF: the worker is gone (or let go); so is its run
                os.killpg(0, _signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
