"""What the client commands print: tables, a job's outcome line, and live progress.

``Progress`` is fed a job's SSE events (``service.cli.client.SseEvent``): metric points update
one live line on a terminal (step/steps, loss, tokens/s, ETA), or become plain lines when
the output is not a terminal; status and lifecycle changes get lines of their own.

Everything a server sent passes through ``clean`` before it is printed (``table`` cleans
every cell, the line builders their lines): a job name or message holding terminal escapes,
CR/LF or bidi overrides shows them as ``\x1b``, ``\r``, ``\u202e`` instead of recolouring
the terminal or forging rows. Only ``trainq logs`` passes the job's own output through as is.
Standard library only.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
import time
from typing import Any, TextIO

__all__ = [
    "Progress",
    "clean",
    "fmt",
    "format_duration",
    "job_rows",
    "job_status",
    "outcome_line",
    "table",
    "trainq_command",
    "when",
]

# C0 controls, DEL, C1 controls, the line and paragraph separators, and the bidi embeddings,
# overrides and isolates: what can move the cursor, recolour, break a line or reorder text.
_UNSAFE = [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F)]
_UNSAFE += range(0x2066, 0x206A)
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}


def clean(value: Any) -> str:
    """``value`` as text that prints as itself: control and bidi characters as escapes."""
    return str(value).translate(_ESCAPES)


def trainq_command() -> str:
    """How to run this trainq again, for hints: ``trainq`` when that is what PATH finds,
    else the path of the running script, else ``python -m service.cli``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0).startswith("trainq") and os.path.isfile(argv0):
        on_path = shutil.which("trainq")
        if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
            return "trainq"
        return shlex.quote(os.path.abspath(argv0))
    return f"{shlex.quote(sys.executable)} -m service.cli"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class Progress:
    """Renders events for one job. ``live`` (default: the stream is a terminal) rewrites one
    line in place; otherwise at most one metric line per ``every_s`` seconds, plus the last."""

    def __init__(
        self, out: TextIO | None = None, *, live: bool | None = None, every_s: float = 1.0
    ) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.every_s = every_s
        self._first: tuple[float, int] | None = None  # (monotonic time, step) of the first point
        self._last_plain = -math.inf
        self._pending: str | None = None  # a throttled plain line not printed yet
        self._on_line = False  # the live line is on screen and must be cleared first

    def eta(self, step: int, steps: int | None, now: float) -> float | None:
        if self._first is None or not steps:
            return None
        t0, s0 = self._first
        if step <= s0 or now <= t0:
            return None
        rate = (step - s0) / (now - t0)
        return (steps - step) / rate

    def metric_line(self, data: dict[str, Any], now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        step = int(data.get("step") or 0)
        steps = data.get("steps") if isinstance(data.get("steps"), int) else None
        if self._first is None:
            self._first = (now, step)
        parts = [f"step {step}/{steps}" if steps else f"step {step}"]
        loss = _num(data.get("loss"))
        parts.append(f"loss {loss:.4f}" if loss is not None else "loss nan")
        val = _num(data.get("val_loss"))
        if val is not None:
            parts.append(f"val {val:.4f}")
        tps = _num(data.get("tokens_per_s"))
        if tps is not None:
            parts.append(f"{tps:,.0f} tok/s")
        eta = self.eta(step, steps, now)
        if steps and step >= steps:
            parts.append("done")
        elif eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return "  ".join(parts)

    def _write_line(self, text: str) -> None:
        if self._on_line:
            self.out.write("\r\x1b[2K")
            self._on_line = False
        self.out.write(clean(text) + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """A line of its own (a status change), keeping the live line below it."""
        self.flush_pending()
        self._write_line(text)

    def flush_pending(self) -> None:
        if self._pending is not None:
            line, self._pending = self._pending, None
            self._write_line(line)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "metric":
            line = self.metric_line(data)
            if self.live:
                self.out.write("\r\x1b[2K" + clean(line))
                self.out.flush()
                self._on_line = True
                return
            now = time.monotonic()
            if now - self._last_plain >= self.every_s:
                self._last_plain = now
                self._pending = None
                self._write_line(line)
            else:
                self._pending = line
        elif kind == "status":
            text = f"status: {data.get('status')}"
            if data.get("reason"):
                text += f" ({data['reason']})"
            if data.get("message"):
                text += f": {data['message']}"
            self.note(text)
        elif kind == "pending":  # the client's own event: why a queued job waits
            self.note(f"waiting: {data.get('pending_reason')}")
        elif kind == "lifecycle":
            phase = data.get("phase")
            attempt = data.get("attempt")
            if phase == "running":
                self.note(f"attempt {attempt} running on {data.get('host') or '?'}")
            elif phase == "exited":
                code = data.get("exit_code")
                why = data.get("reason") or ("ok" if code == 0 else "exit")
                # No exit code: the worker refused the attempt before anything ran.
                ended = "" if code is None else f", exit code {code}"
                self.note(f"attempt {attempt} exited ({why}{ended})")

    def close(self) -> None:
        self.flush_pending()
        if self._on_line:
            self.out.write("\n")
            self.out.flush()
            self._on_line = False


def table(rows: list[list[Any]], header: list[str]) -> str:
    """Aligned columns; every cell cleaned first, so it is one line as wide as it prints."""
    cells = [[clean(c) for c in r] for r in [header, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*cells, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells]
    return "\n".join(lines)


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def when(value: Any) -> str:
    return str(value)[:19].replace("T", " ") if value else "-"


def outcome_line(job: dict[str, Any]) -> str:
    text = f"job {job.get('id')} {job.get('status')}"
    if job.get("reason"):
        text += f" ({job['reason']})"
    if job.get("message"):
        text += f": {' '.join(str(job['message']).split())}"
    latest = job.get("latest") or {}
    loss = _num(latest.get("loss"))
    if job.get("status") == "succeeded" and loss is not None:
        text += f"; final loss {loss:.4f} at step {latest.get('step')}"
    return clean(text)


def job_rows(items: list[dict[str, Any]]) -> str:
    """``trainq ls``: one row per job of a page's items."""
    rows = []
    for j in items:
        latest = j.get("latest") or {}
        steps = f"{latest.get('step')}/{latest.get('steps')}" if latest else "-"
        row = [j.get("id"), j.get("name", ""), j.get("status", ""), j.get("queue", "")]
        rows.append([*row, steps, fmt(latest.get("loss"), ".4f"), when(j.get("created_at"))])
    header = ["ID", "NAME", "STATUS", "QUEUE", "STEP", "LOSS", "CREATED"]
    return table(rows, header) if rows else "no jobs"


def job_status(job: dict[str, Any]) -> str:
    """``trainq status``: status, reason, why it waits, progress, attempts; each line cleaned."""
    lines = [f"job {job.get('id')}  {job.get('name')}  [{job.get('queue')}]"]
    state = str(job.get("status"))
    if job.get("reason"):
        state += f" ({job['reason']})"
    if job.get("message"):
        state += f": {' '.join(str(job['message']).split())}"
    lines.append(f"status:   {state}")
    if job.get("pending_reason"):
        lines.append(f"waiting:  {job['pending_reason']}")
    latest = job.get("latest")
    if isinstance(latest, dict) and latest:
        lines.append(
            f"progress: step {latest.get('step')}/{latest.get('steps')}  "
            f"loss {fmt(latest.get('loss'), '.4f')}  val {fmt(latest.get('val_loss'), '.4f')}"
            f"  {fmt(latest.get('tokens_per_s'), ',.0f')} tok/s"
        )
    for a in job.get("attempts") or []:
        where = a.get("host") or "-"
        ended = f" exit {a['exit_code']}" if a.get("exit_code") is not None else ""
        why = f" ({a['reason']})" if a.get("reason") else ""
        lines.append(f"attempt {a.get('number')}: {a.get('status')} on {where}{ended}{why}")
    lines.append(f"created:  {when(job.get('created_at'))}  ended: {when(job.get('ended_at'))}")
    return "\n".join(clean(line) for line in lines)
