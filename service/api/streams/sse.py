"""Followers of a job's own Redis stream: Server-Sent Events, and ``logs?follow=true``.

One reader per (process, job stream) — a ``Fanout`` owned by the process's ``StreamHub`` —
XREADs the stream with BLOCK, parses each entry and formats its SSE bytes once, and hands
them to every follower's bounded queue. So a process holds one Redis connection per followed
job, not one per follower (redis-py's asyncio pool would refuse follower 101), and an event
costs one parse however many follow it. A follower whose queue fills (a slow client) is
dropped, not waited for: its stream ends and the client resumes with ``Last-Event-ID``.

The stream entry id is the SSE ``id``, so a client reconnecting with ``Last-Event-ID``
resumes exactly after the last event it saw. The hand-over is by entry id: a follower joins
the fan-out first (from then on it is given every entry after the fan-out's position ``L``),
then reads its own backlog from its cursor up to ``L`` with XRANGE; it skips anything at or
before what it has already yielded, so there is neither a gap nor a duplicate.

Streams are bounded: at most ``max_streams`` per process and ``max_per_owner`` per owner
(``StreamHub.admit``: beyond, ``TooManyRequests``, a 429 with Retry-After); a follower holds
at most one backlog batch (``BATCH`` entries) and its queue, however long the stream; and a
follower wakes at least every ``tick_s``, so the route can re-check its token and its age
(``service.api.streams.router``).

No database session lives as long as a stream: when a ping interval passes quietly, the
fan-out reads the row once (in a short session) for all its followers; that read is also how
followers end if the terminal status event itself was missed (or trimmed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from redis import RedisError
from starlette.concurrency import run_in_threadpool

from service.api.core.errors import TooManyRequests
from service.api.core.models import TERMINAL
from trainer.events import NODE_SEQ_SHIFT, Event

__all__ = [
    "Fanout",
    "Follower",
    "StreamHub",
    "follow_logs",
    "format_log_line",
    "format_sse",
    "is_entry_id",
    "sse_events",
]

log = logging.getLogger(__name__)

_ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
BATCH = 500
RETRY = b"retry: 2000\n\n"
PING = b": ping\n\n"

EntryId = tuple[int, int]


def is_entry_id(value: str | None) -> bool:
    return bool(value) and _ENTRY_ID.match(value or "") is not None


def parse_id(value: str) -> EntryId:
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def format_sse(event: str, data: dict[str, Any], entry_id: str | None = None) -> bytes:
    head = f"id: {entry_id}\n" if entry_id else ""
    body = json.dumps(data, separators=(",", ":"))
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def format_log_line(item: dict[str, Any], attempt: int) -> str:
    """``[a2 rank 0] text``: the attempt (a retry's lines follow the first's in one log),
    the node of a multi-node attempt, the rank (``worker`` for torchrun's and the worker's
    own lines), ``stderr`` for that stream."""
    rank, node = item.get("rank"), item.get("node")
    who = "worker" if rank is None else f"rank {rank}"
    if node is not None:  # a multi-node attempt: which host's worker or torchrun said it
        who = f"node {node} {who}"
    who = f"a{attempt} {who}"
    if item.get("stream") == "stderr":
        who += " stderr"
    return f"[{who}] {item.get('line', '')}\n"


def sse_payload(event: Event) -> dict[str, Any]:
    return {"attempt": event.attempt, "source": event.source, "ts": event.ts, **event.data}


@dataclass(frozen=True, slots=True)
class Item:
    """One stream entry, parsed and formatted once for every follower."""

    key: EntryId  # (0, 0) for the synthetic status read from the row
    event: Event
    sse: bytes
    terminal: bool


def _item(entry_id: Any, fields: Any) -> Item | None:
    text = _text(entry_id)
    try:
        event = Event.from_fields(fields)
    except (ValueError, TypeError):
        return None
    terminal = event.kind == "status" and event.data.get("status") in TERMINAL
    return Item(parse_id(text), event, format_sse(event.kind, sse_payload(event), text), terminal)


def _synthetic(status: str | None) -> Item:
    event = Event(
        kind="status",
        job_id="",
        attempt=0,
        source="service",
        seq=0,
        data={"status": status or "unknown", "reason": None, "message": "from the job record"},
    )
    return Item((0, 0), event, format_sse("status", sse_payload(event)), True)


# What a follower's queue carries besides items: a quiet interval passed; you were dropped
# (too slow, or the reader lost Redis); the reader ended (after the terminal status).
_PING = object()
_DROP = object()


class Fanout:
    """The one reader of one job stream in this process, and its followers' queues."""

    def __init__(
        self,
        hub: StreamHub,
        key: str,
        position: str,
        job_status: Callable[[], str | None],
    ) -> None:
        self.hub = hub
        self.key = key
        self.position = position  # the last entry id read; followers get what comes after
        self.job_status = job_status
        self.queues: set[asyncio.Queue[Any]] = set()
        self.task: asyncio.Task[None] | None = None

    def join(self) -> tuple[asyncio.Queue[Any], str]:
        """A queue that gets every entry after the returned position (exclusive)."""
        queue: asyncio.Queue[Any] = asyncio.Queue(self.hub.queue_size)
        self.queues.add(queue)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name=self.key)
        return queue, self.position

    def leave(self, queue: asyncio.Queue[Any]) -> None:
        self.queues.discard(queue)

    def _push(self, message: Any) -> None:
        for queue in list(self.queues):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:
                # Too slow: drop it rather than hold the others back; it resumes by id.
                self.queues.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(_DROP)

    def _close(self) -> None:
        if self.hub.fanouts.get(self.key) is self:
            del self.hub.fanouts[self.key]

    async def _read(self, block: int | None) -> list[tuple[Any, Any]]:
        resp = await self.hub.aredis.xread({self.key: self.position}, count=BATCH, block=block)
        return list(resp[0][1]) if resp else []

    def _dispatch(self, batch: list[tuple[Any, Any]]) -> bool:
        """Hand a batch to every follower; True once the terminal status went out."""
        for entry_id, fields in batch:
            self.position = _text(entry_id)
            item = _item(entry_id, fields)
            if item is None:
                continue
            self._push(item)
            if item.terminal:
                return True
        return False

    async def _run(self) -> None:
        try:
            while self.queues:
                batch = await self._read(self.hub.block_ms)
                if batch:
                    if self._dispatch(batch):
                        break
                    continue
                if not self.queues:
                    break
                status = await run_in_threadpool(self.job_status)
                if status is None or status in TERMINAL:
                    # Missed the status event (or the stream was trimmed): drain, end.
                    batch = await self._read(None)
                    if batch and self._dispatch(batch):
                        break
                    if not batch:
                        self._push(_synthetic(status))
                        break
                else:
                    self._push(_PING)
        except asyncio.CancelledError:
            self._push(_DROP)
            raise
        except (RedisError, OSError) as exc:
            log.info("reader of %s stops: %s", self.key, exc)
            self._push(_DROP)  # followers end; clients reconnect with Last-Event-ID
        except Exception:
            log.exception("reader of %s failed", self.key)
            self._push(_DROP)
        finally:
            # No await between the last check of ``queues`` and this: a follower that joins
            # from now on gets a new fan-out.
            self._close()


class StreamHub:
    """The process's fan-outs, by stream key."""

    def __init__(
        self,
        aredis: Any,
        *,
        ping_s: float,
        queue_size: int = 1024,
        max_streams: int = 1000,
        max_per_owner: int = 32,
    ) -> None:
        self.aredis = aredis
        self.block_ms = max(1, int(ping_s * 1000))
        self.queue_size = queue_size
        self.fanouts: dict[str, Fanout] = {}
        self.max_streams = max_streams
        self.max_per_owner = max_per_owner
        self.open: dict[str, int] = {}  # open followers by owner
        self.total = 0  # their sum: a refusal costs no pass over every owner

    def refusal(self, owner: str) -> TooManyRequests | None:
        """Why a new stream of ``owner`` would be refused now, or None. ``admit`` counts by
        this; the app's edge asks it too, to refuse before routing (``service.api.app``)."""
        if self.total >= self.max_streams:
            return TooManyRequests(
                f"this API process has {self.max_streams} open streams; try again shortly"
            )
        if self.open.get(owner, 0) >= self.max_per_owner:
            return TooManyRequests(
                f"{owner!r} has {self.max_per_owner} open streams already"
                " (TRAINQ_SSE_MAX_STREAMS_PER_OWNER); close one first",
                retry_after=10,
            )
        return None

    def admit(self, owner: str) -> Callable[[], None]:
        """Count a new stream of ``owner``, or refuse it (``refusal``); the returned function
        (idempotent) uncounts it."""
        refused = self.refusal(owner)
        if refused is not None:
            raise refused
        self.open[owner] = self.open.get(owner, 0) + 1
        self.total += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.total -= 1
                left = self.open.get(owner, 1) - 1
                if left > 0:
                    self.open[owner] = left
                else:
                    self.open.pop(owner, None)

        return release

    async def close(self) -> None:
        """Stop every reader (the app is shutting down); their followers end."""
        tasks = [f.task for f in self.fanouts.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.fanouts.clear()

    async def follow(self, key: str, cursor: str, job_status: Callable[[], str | None]) -> Follower:
        """A follower of ``key`` after ``cursor``, its backlog read already (so Redis being
        down is a 503 before the response starts, not a stream that breaks)."""
        fanout = self.fanouts.get(key)
        if fanout is None:
            last = await self.aredis.xrevrange(key, count=1)
            fanout = self.fanouts.get(key)  # another follower may have made it meanwhile
            if fanout is None:
                position = _text(last[0][0]) if last else "0-0"
                fanout = Fanout(self, key, position, job_status)
                self.fanouts[key] = fanout
        queue, upto = fanout.join()
        follower = Follower(fanout, queue, parse_id(cursor), upto)
        try:
            if parse_id(upto) > follower.cursor:
                await follower.backlog(cursor)  # the first batch now, the rest as it goes
        except BaseException:
            follower.close()
            raise
        return follower


class Follower:
    """One client's view: its backlog (XRANGE), then the fan-out's queue."""

    def __init__(
        self, fanout: Fanout, queue: asyncio.Queue[Any], cursor: EntryId, upto: str = "0-0"
    ) -> None:
        self.fanout = fanout
        self.queue = queue
        self.cursor = cursor  # the last entry yielded (or the client's Last-Event-ID)
        self.upto = upto  # the backlog ends here; the fan-out's queue has what follows
        self.first: list[Item] = []
        self.more = False  # the backlog has entries beyond ``first``...
        self.first_after = ""  # ...after this one
        self.on_close: Callable[[], None] | None = None

    async def backlog(self, after: str) -> None:
        """The next batch of the backlog (at most BATCH entries) after ``after``."""
        batch = await self.fanout.hub.aredis.xrange(
            self.fanout.key, "(" + after, self.upto, count=BATCH
        )
        self.first = [i for i in (_item(e, f) for e, f in batch) if i is not None]
        self.more = len(batch) == BATCH
        if self.more:
            self.first_after = _text(batch[-1][0])

    def close(self) -> None:
        self.fanout.leave(self.queue)
        if self.on_close is not None:
            self.on_close()

    async def entries(self, tick_s: float | None = None) -> AsyncIterator[Item | None]:
        """Items in entry-id order, None when a ping interval (or ``tick_s``) passed quietly;
        stops after a terminal status, or when the reader ends or drops this follower."""
        try:
            while True:
                for item in self.first:
                    if item.key > self.cursor:
                        self.cursor = item.key
                        yield item
                        if item.terminal:
                            return
                if not self.more:
                    break
                await self.backlog(self.first_after)
            self.first = []
            while True:
                try:
                    message = await asyncio.wait_for(self.queue.get(), tick_s)
                except TimeoutError:
                    yield None  # a tick: the caller's checks run
                    continue
                if message is _PING:
                    yield None
                    continue
                if message is _DROP:
                    return
                item = message
                if item.key == (0, 0) or item.key > self.cursor:
                    if item.key != (0, 0):
                        self.cursor = item.key
                    yield item
                if item.terminal:
                    return
        finally:
            self.close()


async def sse_events(follower: Follower, tick_s: float | None = None) -> AsyncIterator[bytes]:
    yield RETRY
    async for item in follower.entries(tick_s):
        yield PING if item is None else item.sse


async def follow_logs(
    follower: Follower,
    seen: dict[tuple[int, int], int],
    rank: int | None,
    tick_s: float | None = None,
) -> AsyncIterator[bytes]:
    """Log lines after those already sent from the database (the seq ``seen`` per attempt
    and node: each node of a multi-node attempt numbers its events in a range of its own).
    An empty chunk on a quiet interval or tick: the caller's checks run (it sends nothing)."""
    async for item in follower.entries(tick_s):
        if item is None:
            yield b""
            continue
        event = item.event
        where = (event.attempt, event.seq >> NODE_SEQ_SHIFT)
        if event.kind != "log" or event.seq <= seen.get(where, 0):
            continue
        seen[where] = event.seq
        lines = event.data.get("lines")
        if not isinstance(lines, list):
            continue
        out = "".join(
            format_log_line(x, event.attempt)
            for x in lines
            if isinstance(x, dict) and (rank is None or x.get("rank") == rank)
        )
        if out:
            yield out.encode()
