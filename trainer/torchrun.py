"""``python -m trainer.torchrun ARGS``: torchrun (``torch.distributed.run``) itself, with a
faster exit and short reports of a failure and of a stop.

The interpreter's last full collection walks every object that torch's import made; on a
small CPU that is ~0.4 s after the ranks are done, before the worker can report the exit.
Freezing them first skips that walk (finalizers and atexit handlers still run).

When a rank fails, torchrun raises ChildFailedError out of its main: a traceback of
torchrun's own frames and a 30-line box that says "trainer FAILED" and where to read about
error files, which would be the last lines of every failed run's log, below the rank's own
traceback. Here it is one line per failed rank instead (the same rank, local rank and exit
code, which the worker reads: worker.outcome) and exit status 1, as before.

When torchrun itself is told to stop (SIGTERM from the worker on a cancel, a deadline or a
preemption; SIGINT from a user's Ctrl-C), its agent logs that it got the signal and one
line per rank it passes it on to, then raises SignalException out of main: 25 lines of
torchrun's frames, in the log of every cancelled run. That is an ordinary way to end, not a
fault: here it exits quietly with the shell's status for a signal (128 + N), and the
agent's shutdown notices that follow a stop signal are not printed. The ranks still say
what they did (the step they saved), and the worker says why it stopped the run.

The worker launches runs through this module; arguments and everything else are torchrun's.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

__all__ = ["StopNotices", "failure_lines"]

# The loggers of torchrun's agent and of its process context, and the two notices (their
# format strings, as torch logs them) that a stop signal brings: the first comes from the
# agent when the signal arrives, the others while it passes the signal to each rank.
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
RECEIVED = "Received %s death signal, shutting down workers"
SENDING = "Sending process %s closing signal %s"


class StopNotices(logging.Filter):
    """Drops the agent's notice that it got a stop signal and, from then on, its notices of
    passing the signal to each rank. Before a stop signal, nothing is dropped: when a rank
    fails, the notices of the others being stopped stay in the log."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == RECEIVED:
            self.stopping = True
            return False
        return not (self.stopping and record.msg == SENDING)

    def install(self) -> StopNotices:
        for name in (AGENT_LOGGER, PROCS_LOGGER):
            logging.getLogger(name).addFilter(self)
        return self


def failure_lines(exc: ChildFailedError) -> list[str]:
    """One line per failed rank: ``rank 1 (local_rank: 1) failed with exitcode: -9 (SIGKILL)``."""
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        code = failure.exitcode
        how = f"exitcode: {code}"
        if code < 0:
            try:
                how += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        lines.append(
            f"trainer.torchrun: rank {rank} (local_rank: {failure.local_rank}) failed with {how}"
        )
    return lines


if __name__ == "__main__":
    StopNotices().install()
    try:
        main()
    except ChildFailedError as exc:
        print("\n".join(failure_lines(exc)), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except SignalException as exc:
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        gc.freeze()
