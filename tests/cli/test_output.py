"""The progress line: rewritten in place on a terminal, plain throttled lines elsewhere."""

from __future__ import annotations

import io

from service.cli.client import parse_sse
from service.cli.output import Progress, clean, format_duration, job_rows, job_status, outcome_line


def _metric(step: int, loss: float | None = 2.0) -> dict[str, object]:
    return {"step": step, "steps": 100, "loss": loss, "tokens_per_s": 12345.6}


def test_live_line_is_rewritten_in_place_and_ends_with_a_newline() -> None:
    out = io.StringIO()
    p = Progress(out, live=True)
    p.event("metric", _metric(1))
    p.event("metric", _metric(2))
    p.event("status", {"status": "succeeded", "reason": None, "message": "done"})
    p.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K") >= 3  # each metric rewrites the line; the note clears it
    assert "step 2/100  loss 2.0000  12,346 tok/s" in text
    assert text.endswith("status: succeeded: done\n")


def test_plain_lines_are_throttled_but_the_last_point_is_kept() -> None:
    out = io.StringIO()
    p = Progress(out, live=False, every_s=3600)
    for step in range(1, 51):
        p.event("metric", _metric(step, loss=None if step == 50 else 2.0))
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/100  loss 2.0000  12,346 tok/s", lines[1]]
    assert lines[1].startswith("step 50/100  loss nan") and "ETA" in lines[1]
    assert "\r" not in out.getvalue()


def test_eta_comes_from_the_observed_rate() -> None:
    p = Progress(io.StringIO(), live=False)
    p.metric_line(_metric(10), now=100.0)
    assert p.eta(20, 100, now=110.0) == 80.0  # 1 step/s, 80 steps left
    assert format_duration(80) == "1m20s" and format_duration(7300) == "2h01m"


def test_sse_framing() -> None:
    lines = iter(
        [
            "retry: 2000",
            "",
            ": ping",
            "id: 5-0",
            "event: metric",
            'data: {"step": 3}',
            "",
            "event: status",
            'data: {"status": "succeeded"}',
            "",
        ]
    )
    events = list(parse_sse(lines))
    assert [(e.event, e.id, e.data) for e in events] == [
        ("metric", "5-0", {"step": 3}),
        ("status", None, {"status": "succeeded"}),
    ]


# -- what a server sent is shown, never obeyed --------------------------------------------------

EVIL = "bad\x1b[31mred\r\nabc123  forged  succeeded\u202egnp.exe\x9b"


def _evil_job() -> dict[str, object]:
    return {
        "id": "abc123",
        "name": EVIL,
        "status": "failed",
        "reason": "exit_code",
        "message": "boom\x1b]0;title\x07",
        "queue": "cpu",
        "labels": {"team": EVIL},
        "pending_reason": None,
        "latest": {"step": 3, "steps": 10, "loss": 2.5},
        "attempts": [{"number": 1, "status": "exited", "host": "h\rost", "exit_code": 1}],
        "created_at": "2025-01-01T00:00:00",
    }


def _assert_inert(text: str, lines: int) -> None:
    assert len(text.split("\n")) == lines, text  # no value added a line
    for bad in ("\x1b", "\r", "\u202e", "\x9b", "\x07"):
        assert bad not in text, repr(text)


def test_ls_and_status_show_control_characters_as_escapes() -> None:
    job = _evil_job()
    rows = job_rows([job])
    _assert_inert(rows, 2)
    assert "bad\\x1b[31mred\\x0d\\x0aabc123  forged  succeeded\\u202egnp.exe\\x9b" in rows
    status = job_status(job)
    _assert_inert(status, 5)
    assert "boom\\x1b]0;title\\x07" in status and "on h\\x0dost exit 1" in status
    line = outcome_line(job)
    _assert_inert(line, 1)
    assert line.startswith("job abc123 failed (exit_code): boom\\x1b")


def test_progress_escapes_what_the_stream_says() -> None:
    out = io.StringIO()
    p = Progress(out, live=True)
    p.event("status", {"status": "failed", "reason": "x", "message": EVIL})
    p.event("lifecycle", {"phase": "running", "attempt": 1, "host": "\x1b[2Jhost"})
    p.close()
    # The live line's own "\r\x1b[2K" is Progress's; nothing else may carry an escape.
    text = out.getvalue().replace("\r\x1b[2K", "")
    _assert_inert(text, 3)
    assert "running on \\x1b[2Jhost" in text


def test_every_unsafe_character_class_is_escaped() -> None:
    unsafe = [0x00, 0x09, 0x0A, 0x0D, 0x1B, 0x7F, 0x85, 0x9B, 0x2028, 0x2029]
    unsafe += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    for code in unsafe:
        shown = clean(f"a{chr(code)}b")
        assert chr(code) not in shown and shown.startswith("a\\") and shown.endswith("b")
    assert clean("plain ünïcode ✓ 3.5") == "plain ünïcode ✓ 3.5"


# -- lifecycle and pending lines ----------------------------------------------------------------


def test_an_attempt_refused_before_it_ran_has_no_exit_code_line() -> None:
    out = io.StringIO()
    p = Progress(out, live=False)
    p.event("lifecycle", {"phase": "exited", "attempt": 1, "reason": "spec_error"})
    p.event("lifecycle", {"phase": "exited", "attempt": 2, "exit_code": 0})
    p.event("pending", {"status": "queued", "pending_reason": "no worker serves queue gpu"})
    assert out.getvalue().splitlines() == [
        "attempt 1 exited (spec_error)",
        "attempt 2 exited (ok, exit code 0)",
        "waiting: no worker serves queue gpu",
    ]
    assert "None" not in out.getvalue()
