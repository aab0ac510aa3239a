"""Followers of a job's own Redis stream: Server-Sent Events, and ``logs?follow=true``.

Each follower XREADs ``Keys.job(id)`` with BLOCK, so an event reaches it as soon as it is
added; the stream entry id is the SSE ``id``, so a client reconnecting with ``Last-Event-ID``
resumes exactly after the last event it saw. No database session lives as long as a stream:
the row is read in short sessions, at the start and when a ping interval passes quietly, and
that read is also how a follower ends if the terminal status event itself was missed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis import RedisError
from starlette.concurrency import run_in_threadpool

from service.models import TERMINAL
from trainer.events import Event

__all__ = ["StreamReader", "format_log_line", "format_sse", "is_entry_id"]

log = logging.getLogger(__name__)

_ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
BATCH = 500


def is_entry_id(value: str | None) -> bool:
    return bool(value) and _ENTRY_ID.match(value or "") is not None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def format_sse(event: str, data: dict[str, Any], entry_id: str | None = None) -> bytes:
    head = f"id: {entry_id}\n" if entry_id else ""
    body = json.dumps(data, separators=(",", ":"))
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def format_log_line(item: dict[str, Any]) -> str:
    rank = item.get("rank")
    who = "worker" if rank is None else f"rank {rank}"
    if item.get("stream") == "stderr":
        who += " stderr"
    return f"[{who}] {item.get('line', '')}\n"


class StreamReader:
    """Reads one job's stream from ``cursor`` on; ``first`` is read eagerly so that Redis
    being down is a 503 before the response starts rather than a stream that breaks."""

    def __init__(
        self,
        aredis: Any,
        key: str,
        cursor: str,
        *,
        ping_s: float,
        job_status: Callable[[], str | None],
    ) -> None:
        self.aredis = aredis
        self.key = key
        self.cursor = cursor
        self.block_ms = max(1, int(ping_s * 1000))
        self.job_status = job_status
        self.first: list[tuple[Any, Any]] = []

    async def open(self) -> None:
        self.first = await self._read(None)

    async def _read(self, block: int | None) -> list[tuple[Any, Any]]:
        resp = await self.aredis.xread({self.key: self.cursor}, count=BATCH, block=block)
        return list(resp[0][1]) if resp else []

    async def entries(self) -> AsyncIterator[tuple[str, Event] | None]:
        """Yield (entry id, event) as they come, None when a ping interval passed quietly;
        stop after a terminal status event, or when the row says the job has ended."""
        batch, self.first = self.first, []
        while True:
            if not batch:
                try:
                    batch = await self._read(self.block_ms)
                except (RedisError, OSError) as exc:
                    log.info("follower of %s stops: %s", self.key, exc)
                    return  # the client reconnects with Last-Event-ID
                if not batch:
                    status = await run_in_threadpool(self.job_status)
                    if status is None or status in TERMINAL:
                        # Missed the status event (or the stream was trimmed): drain, end.
                        batch = await self._read(None)
                        if not batch:
                            yield ("", _synthetic(status))
                            return
                    else:
                        yield None
                        continue
            for entry_id, fields in batch:
                self.cursor = _text(entry_id)
                try:
                    event = Event.from_fields(fields)
                except (ValueError, TypeError):
                    continue
                yield (self.cursor, event)
                if event.kind == "status" and event.data.get("status") in TERMINAL:
                    return
            batch = []


def _synthetic(status: str | None) -> Event:
    return Event(
        kind="status",
        job_id="",
        attempt=0,
        source="service",
        seq=0,
        data={"status": status or "unknown", "reason": None, "message": "from the job record"},
    )


def sse_payload(event: Event) -> dict[str, Any]:
    return {"attempt": event.attempt, "source": event.source, "ts": event.ts, **event.data}


async def sse_events(reader: StreamReader) -> AsyncIterator[bytes]:
    yield b"retry: 2000\n\n"
    async for item in reader.entries():
        if item is None:
            yield b": ping\n\n"
            continue
        entry_id, event = item
        yield format_sse(event.kind, sse_payload(event), entry_id or None)


async def follow_logs(
    reader: StreamReader, seen: dict[int, int], rank: int | None
) -> AsyncIterator[bytes]:
    """Log lines after those already sent from the database (per-attempt seq ``seen``)."""
    async for item in reader.entries():
        if item is None:
            continue  # chunked text has no comment lines; the row check above still runs
        _, event = item
        if event.kind != "log" or event.seq <= seen.get(event.attempt, 0):
            continue
        seen[event.attempt] = event.seq
        lines = event.data.get("lines")
        if not isinstance(lines, list):
            continue
        out = "".join(
            format_log_line(x)
            for x in lines
            if isinstance(x, dict) and (rank is None or x.get("rank") == rank)
        )
        if out:
            yield out.encode()
