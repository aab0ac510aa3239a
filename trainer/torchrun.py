"""``python -m trainer.torchrun ARGS``: torchrun (``torch.distributed.run``) itself, with a
faster exit and a short failure report.

The interpreter's last full collection walks every object that torch's import made; on a
small CPU that is ~0.4 s after the ranks are done, before the worker can report the exit.
Freezing them first skips that walk (finalizers and atexit handlers still run).

When a rank fails, torchrun raises ChildFailedError out of its main: a traceback of
torchrun's own frames and a 30-line box that says "trainer FAILED" and where to read about
error files, which would be the last lines of every failed run's log, below the rank's own
traceback. Here it is one line per failed rank instead (the same rank, local rank and exit
code, which the worker reads: worker.outcome) and exit status 1, as before.

The worker launches runs through this module; arguments and everything else are torchrun's.
"""

from __future__ import annotations

import gc
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

__all__ = ["failure_lines"]


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
    try:
        main()
    except ChildFailedError as exc:
        print("\n".join(failure_lines(exc)), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        gc.freeze()
