"""Exit classification: how an attempt ended, as the (reason, message) of its exited event.

Order: a stop the worker itself asked for (cancelled, timeout, preempted) wins; then exit
status 0 is success; then the trainer's own ``exit.json`` (nan_loss, oom, spec_error, ...);
then the failed rank's exit code from torchrun's failure summary (torchrun folds it into
its own status 1); anything else is ``exit_code`` with the last log lines.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainer.events import REASONS, ExitCode

__all__ = ["Outcome", "classify", "rank_exit_code", "read_exit_json"]

_CODE_REASON = {
    ExitCode.NAN_LOSS: "nan_loss",
    ExitCode.OOM: "oom",
    ExitCode.SPEC_ERROR: "spec_error",
    ExitCode.DATA_ERROR: "spec_error",
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


def rank_exit_code(agent_lines: Iterable[str]) -> tuple[int, int | None] | None:
    """(exit code, local rank) of the first failed rank torchrun reported, if any."""
    for line in agent_lines:
        m = _EXITCODE.search(line)
        if m:
            r = _RANK.search(line)
            rank = next((int(g) for g in r.groups() if g is not None), None) if r else None
            return int(m.group(1)), rank
    return None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def classify(
    code: int,
    *,
    stop_reason: str | None,
    stop_message: str,
    exit_info: dict[str, object] | None,
    agent_lines: Iterable[str],
    tail: Iterable[str],
) -> Outcome:
    if stop_reason is not None:
        return Outcome(code, stop_reason, stop_message)
    if code == 0:
        # A trainer SIGTERMed by someone else (the host, a scheduler) checkpoints and exits 0.
        if exit_info and exit_info.get("reason") == "preempted":
            return Outcome(0, "preempted", str(exit_info.get("message") or "preempted"))
        return Outcome(0, None, "succeeded")
    if exit_info and exit_info.get("reason") in REASONS:
        where = []
        if exit_info.get("rank") is not None:
            where.append(f"rank {exit_info['rank']}")
        if exit_info.get("step") is not None:
            where.append(f"step {exit_info['step']}")
        text = str(exit_info.get("message") or exit_info["reason"])
        message = f"{text} ({', '.join(where)})" if where else text
        return Outcome(code, str(exit_info["reason"]), message)
    failed = rank_exit_code(agent_lines)
    if failed is not None and failed[0] in _CODE_REASON:
        rc, rank = failed
        who = f"rank {rank}" if rank is not None else "a rank"
        return Outcome(code, _CODE_REASON[ExitCode(rc)], f"{who} exited with {_describe(rc)}")
    if failed is not None:
        rc, rank = failed
        who = f"local rank {rank}" if rank is not None else "a rank"
        head = f"torchrun exited with code {code}: {who} {_describe(rc)}"
    else:
        head = f"torchrun exited with {_describe(code)}"
    lines = list(tail)
    message = head + ("; last lines:\n" + "\n".join(lines) if lines else "")
    return Outcome(code, "exit_code", message)
