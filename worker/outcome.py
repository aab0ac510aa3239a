"""Exit classification: how an attempt ended, as the (reason, message) of its exited event.

Order: a stop the worker itself asked for (cancelled, timeout, preempted) wins, with the
signal the worker sent as its exit code; then exit status 0 is success; then the trainer's
own ``exit.json`` (nan_loss, oom, spec_error, ...); then the failed rank's exit code from
torchrun's failure report (torchrun folds it into its own status 1); anything else is
``exit_code``. Its message is the trainer's own error line when a rank recorded one in
exit.json (``IndexError: ...``), and otherwise what torchrun reported plus the ranks' last
log lines.

A rank killed by a signal (SIGKILL, SIGSEGV, the OOM killer) records nothing, while the
other ranks then fail in their next collective and may record that: torchrun's report of
the signal comes first in the message, the others' error after it. SIGTERM is not such a
cause: torchrun sends it to the ranks left once one failed, and may report them with it.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainer.events import REASONS, ExitCode

__all__ = ["Outcome", "classify", "rank_exit_code", "read_exit_json", "stop_line"]

_CODE_REASON = {
    ExitCode.NAN_LOSS: "nan_loss",
    ExitCode.OOM: "oom",
    ExitCode.SPEC_ERROR: "spec_error",
    ExitCode.DATA_ERROR: "spec_error",
    ExitCode.DISK_FULL: "disk_full",
    # A newer attempt holds the job: the service already counts this one lost, and its
    # exit event changes nothing.
    ExitCode.SUPERSEDED: "superseded",
}
# torchrun: "failed (exitcode: 75) local_rank: 1 ..." and the summary "exitcode  : 75 (pid: ..)"
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RANK = re.compile(r"local_rank:\s*(\d+)|rank\s*:\s*(\d+)")


@dataclass(frozen=True)
class Outcome:
    exit_code: int | None
    reason: str | None  # None with exit_code 0 is success
    message: str

    def data(self) -> dict[str, object]:
        return {
            "phase": "exited",
            "exit_code": self.exit_code,
            "reason": self.reason,
            "message": self.message,
        }


def read_exit_json(run_dir: Path) -> dict[str, object] | None:
    try:
        data = json.loads((run_dir / "exit.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _killed(code: int) -> bool:
    """Killed by a signal that torchrun does not send itself: the cause of a failure."""
    return code < 0 and -code != signal.SIGTERM


def rank_exit_code(agent_lines: Iterable[str]) -> tuple[int, int | None] | None:
    """(exit code, local rank) of the failed rank torchrun reported, if any: the first one
    killed by a signal (not SIGTERM), else the first that exited, else the first.

    torchrun names its first failure by a timestamp in whole seconds, so a rank that failed
    in a collective because its peer was killed may be named first; and the ranks it
    SIGTERMs once one has failed may be listed as failed too.
    """
    found = []
    for line in agent_lines:
        m = _EXITCODE.search(line)
        if m:
            r = _RANK.search(line)
            rank = next((int(g) for g in r.groups() if g is not None), None) if r else None
            found.append((int(m.group(1)), rank))
    # sorted() is stable: within each kind, torchrun's order.
    ranked = sorted(found, key=lambda f: 0 if _killed(f[0]) else 1 if f[0] >= 0 else 2)
    return ranked[0] if ranked else None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _located(exit_info: dict[str, object]) -> str:
    """exit.json's message with the rank and step it names: ``... (rank 1, step 7)``."""
    where = []
    if exit_info.get("rank") is not None:
        where.append(f"rank {exit_info['rank']}")
    if exit_info.get("step") is not None:
        where.append(f"step {exit_info['step']}")
    text = str(exit_info.get("message") or exit_info["reason"])
    return f"{text} ({', '.join(where)})" if where else text


def classify(
    code: int,
    *,
    stop_reason: str | None,
    stop_message: str,
    exit_info: dict[str, object] | None,
    agent_lines: Iterable[str],
    tail: Iterable[str],
    stop_signal: int | None = None,
) -> Outcome:
    if stop_reason is not None:
        # torchrun exits 1 after a SIGTERM whatever its ranks did, which reads as a failure
        # of the run. The exit code says what the worker did instead: -15 (SIGTERM), or -9
        # when the grace ran out, negative as in Python's returncode (128+N could be a
        # program's own exit status). None when nothing was running to signal.
        return Outcome(-stop_signal if stop_signal else code, stop_reason, stop_message)
    if code == 0:
        # A trainer SIGTERMed by someone else (the host, a scheduler) checkpoints and exits 0.
        if exit_info and exit_info.get("reason") == "preempted":
            return Outcome(0, "preempted", str(exit_info.get("message") or "preempted"))
        return Outcome(0, None, "succeeded")
    crash = None  # a rank's own uncaught exception, recorded by the trainer (trainer.env)
    if exit_info and exit_info.get("reason") in REASONS:
        if exit_info["reason"] != "exit_code":
            return Outcome(code, str(exit_info["reason"]), _located(exit_info))
        crash = _located(exit_info)
    failed = rank_exit_code(agent_lines)
    if failed is not None and failed[0] in _CODE_REASON:
        rc, rank = failed
        who = f"rank {rank}" if rank is not None else "a rank"
        text = f"{who} exited with {_describe(rc)}"
        if rc == ExitCode.SUPERSEDED:  # no exit.json (trainer.fence): the rank's own line
            text = next((ln for ln in tail if "SUPERSEDED" in ln), text)
        return Outcome(code, _CODE_REASON[ExitCode(rc)], text)
    if crash is not None and (failed is None or not _killed(failed[0])):
        return Outcome(code, "exit_code", crash)
    if failed is not None:
        rc, rank = failed
        who = f"local rank {rank}" if rank is not None else "a rank"
        head = f"torchrun exited with code {code}: {who} {_describe(rc)}"
        if crash is not None:
            head += f"; then {crash}"
    else:
        head = f"torchrun exited with {_describe(code)}"
    lines = list(tail)
    message = head + ("; last lines:\n" + "\n".join(lines) if lines else "")
    return Outcome(code, "exit_code", message)


def stop_line(
    message: str, stop_signal: int | None, exit_info: dict[str, object] | None, grace_s: float
) -> str:
    """The one log line that ends an attempt the worker stopped: why (``message``: the
    cancel, the deadline, the preemption) and how far the run got, from the step the ranks
    recorded when they saved on the way out (trainer.train), or the signal that ended it."""
    step = exit_info.get("step") if exit_info and exit_info.get("reason") == "preempted" else None
    if step is not None:
        how = f"stopped at step {step} (checkpoint saved)"
    elif stop_signal == signal.SIGKILL:
        how = f"killed: still running {grace_s:g} s after SIGTERM"
    elif stop_signal is None:
        how = "the run had already ended"
    else:
        how = "stopped before saving a checkpoint"
    return f"{message}; {how}"
