"""The progress line: rewritten in place on a terminal, plain throttled lines elsewhere."""

from __future__ import annotations

import io

from service.cli.client import parse_sse
from service.cli.output import Progress, format_duration


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
