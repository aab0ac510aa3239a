"""``python -m trainer.torchrun ARGS``: torchrun (``torch.distributed.run``) itself, with a
faster exit.

The interpreter's last full collection walks every object that torch's import made; on a
small CPU that is ~0.4 s after the ranks are done, before the worker can report the exit.
Freezing them first skips that walk (finalizers and atexit handlers still run). The worker
launches runs through this module; arguments, exit codes and output are torchrun's own.
"""

from __future__ import annotations

import gc

from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    finally:
        gc.freeze()
