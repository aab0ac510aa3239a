"""The trainer's contract with its launcher: the environment in, RUN_DIR/exit.json out.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
the worker adds TRAINQ_REDIS_URL, TRAINQ_REDIS_PREFIX, TRAINQ_JOB_ID, TRAINQ_ATTEMPT and, when
its admin allows trackers at private addresses, TRAINQ_TRACKING_ALLOW_PRIVATE=1. Nothing else
in the trainer reads ``os.environ`` (torch.distributed reads MASTER_* itself at init).
Torch-free, so a bad config is refused before torch is even imported.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainer.files import FILE_MODE, make_dirs, set_mode

__all__ = [
    "CRASH_EXIT_CODE",
    "EXIT_FILE",
    "TrainerEnv",
    "error_line",
    "exit_with_launcher",
    "read_env",
    "write_crash",
    "write_exit_file",
]

EXIT_FILE = "exit.json"
# How Python exits on an uncaught exception; exit.json says so for a crash record.
CRASH_EXIT_CODE = 1
MAX_ERROR_CHARS = 400  # an error line in exit.json and in the attempt's message


@dataclass(frozen=True)
class TrainerEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # the ranks of this node (torchrun's --nproc-per-node)
    distributed: bool = False  # launched by torchrun (even with one rank)
    redis_url: str | None = None
    redis_prefix: str = "trainq"
    job_id: str | None = None
    attempt: int = 1
    tracking_allow_private: bool = False  # a tracking URI may reach private addresses

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        """The nodes of the launch (torchrun gives every node the same number of ranks)."""
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def read_env(env: Mapping[str, str] | None = None) -> TrainerEnv:
    """The torchrun and trainq variables; ValueError names a malformed one."""
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in WORLD_SIZE={world}")
    return TrainerEnv(
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=world,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
        distributed="RANK" in env and "WORLD_SIZE" in env,
        redis_url=env.get("TRAINQ_REDIS_URL") or None,
        redis_prefix=env.get("TRAINQ_REDIS_PREFIX") or "trainq",
        job_id=env.get("TRAINQ_JOB_ID") or None,
        attempt=_int(env, "TRAINQ_ATTEMPT", 1),
        tracking_allow_private=env.get("TRAINQ_TRACKING_ALLOW_PRIVATE", "") in ("1", "true"),
    )


def write_exit_file(
    run_dir: Path, reason: str, message: str, *, rank: int, step: int | None, exit_code: int
) -> bool:
    """Write RUN_DIR/exit.json unless another rank already did (the first failing rank wins).

    torchrun folds a rank's exit code into its own, so this file is how the worker learns
    why a run ended. Returns False when the file was already there.
    """
    record = {
        "reason": reason,
        "message": message,
        "rank": rank,
        "step": step,
        "exit_code": exit_code,
    }
    make_dirs(run_dir)
    try:
        fd = os.open(run_dir / EXIT_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    set_mode(fd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return True


def error_line(exc: BaseException, limit: int = MAX_ERROR_CHARS) -> str:
    """An exception as the last line of its traceback: ``IndexError: index out of range in
    self``, one line (the message's first non-empty one), at most ``limit`` characters."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    line = f"{name}: {text}" if text else name
    return line if len(line) <= limit else line[: limit - 3] + "..."


def write_crash(run_dir: Path, exc: BaseException, *, rank: int, step: int | None) -> bool:
    """Record an uncaught exception of this rank in RUN_DIR/exit.json (the first failing rank
    wins), so the attempt's message is the trainer's own error rather than torchrun's
    report that a child failed. The reason is ``exit_code``: a crash is no known failure.

    Call it before the process group is torn down: a rank that leaves the group first
    makes the others fail with connection errors, which must not get in before it.
    """
    try:
        return write_exit_file(
            run_dir, "exit_code", error_line(exc), rank=rank, step=step,
            exit_code=CRASH_EXIT_CODE,
        )  # fmt: skip
    except OSError:  # the run dir is unwritable: the traceback in the log still says it
        return False


def exit_with_launcher(poll_s: float = 0.1) -> None:
    """Exit this rank soon after its launcher (torchrun) dies.

    torchrun starts every rank in a session of its own, so a SIGKILL to torchrun's process
    group (a worker's hard stop) does not reach the ranks: they would train on as orphans and
    race the next attempt for the run dir. A daemon thread waits on a pidfd of the launcher,
    which becomes readable when it exits: no wake-up at all while it lives, where polling
    ``getppid`` every ``poll_s`` woke every rank 10 times a second for the GIL (polling is
    the fallback where pidfd_open is missing).
    """
    parent = os.getppid()
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):
        pidfd = None

    def watch() -> None:
        # Opened after getppid: if the launcher died in between, its pid may name another
        # process by now, but then this rank was already reparented, and the check skips it.
        if pidfd is not None and os.getppid() == parent:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()  # returns once the launcher has exited
        while os.getppid() == parent:  # reparenting comes with that exit; or no pidfd: poll
            time.sleep(poll_s)
        os.write(2, f"trainer: launcher (pid {parent}) is gone; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
