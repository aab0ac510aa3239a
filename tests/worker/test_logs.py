"""worker.logs: what a run prints reaches Redis tagged and in order, and a run that prints
without end is capped (first lines, a line saying how many were not kept, last lines)."""

from __future__ import annotations

import os
import threading

import redis

from trainer.events import Event, Keys, Publisher
from worker.logs import LogForwarder


def _forward(redis_url: str, keys: Keys, job: str, n: int, **caps: int) -> list[dict[str, object]]:
    """Print ``n`` rank-0 lines through a real pipe into a LogForwarder and a real Publisher;
    the log lines as they landed in the job's stream."""
    pub = Publisher(redis_url, job, 1, "worker", prefix=keys.prefix)
    fwd = LogForwarder(pub, batch_lines=50, batch_s=0.05, **caps)
    read_end, write_end = os.pipe()
    reader = os.fdopen(read_end, "rb")
    fwd.attach(reader, "stdout")

    def printer() -> None:
        with os.fdopen(write_end, "wb") as out:
            for i in range(n):
                out.write(b"[rank0]:line %d\n" % i)

    t = threading.Thread(target=printer)
    t.start()
    t.join(30)
    fwd.close(timeout=10)
    reader.close()
    assert pub.close(timeout=10)
    client = redis.Redis.from_url(redis_url)
    events = [Event.from_fields(f) for _, f in client.xrange(keys.job(job))]
    client.close()
    return [line for ev in events if ev.kind == "log" for line in ev.data["lines"]]


def test_every_line_arrives_tagged_and_in_order(redis_url: str) -> None:
    lines = _forward(redis_url, Keys("tq-logs-a"), "job-a", 500)
    assert [ln["line"] for ln in lines] == [f"line {i}" for i in range(500)]
    assert {(ln["rank"], ln["stream"]) for ln in lines} == {(0, "stdout")}


def test_a_runaway_printer_keeps_its_head_and_tail(redis_url: str) -> None:
    lines = _forward(redis_url, Keys("tq-logs-b"), "job-b", 5000, max_lines=300, keep_last=100)
    text = [ln["line"] for ln in lines]
    assert text[:300] == [f"line {i}" for i in range(300)]
    assert text[300] == (
        "trainq: 4600 log lines not kept: this attempt printed 5000, past the cap of 300;"
        " its last 100 follow"
    )
    assert lines[300]["rank"] is None and lines[300]["stream"] == "stderr"
    assert text[301:] == [f"line {i}" for i in range(4900, 5000)]


def test_a_run_just_past_the_cap_loses_nothing(redis_url: str) -> None:
    lines = _forward(redis_url, Keys("tq-logs-c"), "job-c", 350, max_lines=300, keep_last=100)
    assert [ln["line"] for ln in lines] == [f"line {i}" for i in range(350)]
