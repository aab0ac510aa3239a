"""A job's event stream (Server-Sent Events) as the CLI reads it: the framing
(``parse_sse``) and the follow loop (``follow_events``) that reconnects with Last-Event-ID,
bounds every wait by a deadline and reads a queued job's pending reason.

``Client.events`` and ``Client.follow_events`` (``service.cli.client``) are the way in; this
module holds the loop so the client stays a list of endpoints.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from service.cli.errors import TERMINAL, NotTrainq, Unavailable, Unreachable

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = [
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE",
    "SSE_READ_TIMEOUT_S",
    "SseEvent",
    "follow_events",
    "parse_sse",
]

# One SSE connection's read timeout when nothing bounds it sooner: longer than the server's
# keep-alive ping interval (TRAINQ_SSE_PING_S, 15 s), so only a stuck connection hits it.
SSE_READ_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
# The name parse_sse gives a keep-alive comment when asked to yield them (no trainq stream
# sends an event of that name).
KEEPALIVE = ": keepalive"


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: dict[str, Any]
    id: str | None = None


def follow_events(
    client: Client,
    job_id: str,
    *,
    deadline: float | None = None,
    outage_s: float = 30.0,
    pending_every_s: float | None = None,
) -> Generator[SseEvent, None, None]:
    """The job's events until its terminal status, reconnecting with Last-Event-ID.

    ``deadline`` (a ``time.monotonic()`` value) raises TimeoutError once it passes, in
    every state: each connection's connect and read timeouts and the sleep between
    connections are bounded by the time left, and whatever arrives (an event or a
    keep-alive comment, which restarts the read timeout) is followed by a look at the
    deadline; once less is left than the connection's read timeout, it is reopened
    (from Last-Event-ID, so nothing is lost) with the time left as its read timeout.
    A queued job's stream (keep-alive comments only) cannot hold the caller past it.
    The service being unreachable for more than ``outage_s`` in a row raises Unreachable.

    With ``pending_every_s``, the job's record is read when following starts and, while
    the job is queued and its stream is quiet, at most that often; a change of its
    pending reason is yielded as a ``pending`` event (``{"status", "pending_reason"}``).
    """
    last_id: str | None = None
    down_since: float | None = None
    watch = pending_every_s is not None
    queued = watch  # not known yet: the record is read first
    reason: str | None = None
    next_read = time.monotonic()

    def left(cap: float) -> float:
        """``cap`` seconds, or what is left before the deadline; TimeoutError once past."""
        if deadline is None:
            return cap
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return min(cap, remaining)

    def check_deadline() -> None:
        left(0.0)

    while True:
        try:
            if queued and time.monotonic() >= next_read:
                job = client.job(job_id, timeout=left(CONNECT_TIMEOUT_S))
                down_since = None
                next_read = time.monotonic() + (pending_every_s or 0.0)
                queued = job.get("status") == "queued"
                new = job.get("pending_reason") if queued else None
                if isinstance(new, str) and new and new != reason:
                    yield SseEvent("pending", {"status": "queued", "pending_reason": new})
                reason = new
            # A queued job's stream stays silent: wake up for the next read of its record.
            wake = next_read - time.monotonic() if queued else SSE_READ_TIMEOUT_S
            read_timeout = left(min(max(wake, 0.1), SSE_READ_TIMEOUT_S))
            connection = client.events(
                job_id,
                last_event_id=last_id,
                read_timeout=read_timeout,
                connect_timeout=left(CONNECT_TIMEOUT_S),
                keepalives=deadline is not None,
            )
            closed = True  # by the server, as opposed to by us to read the record
            try:
                with contextlib.closing(connection):
                    for ev in connection:
                        down_since = None
                        if ev.event == KEEPALIVE:
                            # The read timeout starts again at each comment: the next
                            # wait must not outlast the deadline.
                            if left(read_timeout) < read_timeout:
                                closed = False
                                break
                            continue
                        if ev.id:
                            last_id = ev.id
                        status = ev.data.get("status") if ev.event == "status" else None
                        if status is not None:
                            if watch and status == "queued" and not queued:  # a retry
                                reason, next_read = None, time.monotonic()
                            queued = watch and status == "queued"
                        yield ev
                        if status in TERMINAL:
                            return
                        check_deadline()  # between events too
                        if queued and time.monotonic() >= next_read:
                            closed = False
                            break
            except Unreachable as exc:
                # Only a wait we shortened ran out (the deadline is near, or the record
                # is due): not an outage. A stuck server still fails the record's read.
                if read_timeout >= SSE_READ_TIMEOUT_S or not _is_read_timeout(exc):
                    raise
                check_deadline()
                closed = False
            if not closed:
                continue
            # The stream closed without a terminal status event: ask the record.
            if client.job(job_id, timeout=left(CONNECT_TIMEOUT_S)).get("status") in TERMINAL:
                return
        except NotTrainq:
            raise
        except (Unreachable, Unavailable):
            check_deadline()  # a timeout at the deadline is the deadline, not an outage
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since > outage_s:
                raise
        time.sleep(left(1.0))


def _is_read_timeout(exc: BaseException) -> bool:
    return isinstance(exc.__cause__, httpx.ReadTimeout)


def parse_sse(lines: Iterator[str], *, keepalives: bool = False) -> Iterator[SseEvent]:
    """Server-Sent Events framing: ``id:``, ``event:``, ``data:``; a blank line dispatches.
    A comment (``: ping``) is skipped, or with ``keepalives`` yielded as ``KEEPALIVE``."""
    event, entry_id = "message", None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    payload = {"text": "\n".join(data)}
                if not isinstance(payload, dict):
                    payload = {"value": payload}
                yield SseEvent(event, payload, entry_id)
            event, data, entry_id = "message", [], None
            continue
        if line.startswith(":"):
            if keepalives:
                yield SseEvent(KEEPALIVE, {})
            continue  # a keep-alive comment
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            entry_id = value
