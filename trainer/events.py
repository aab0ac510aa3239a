"""Event records on the second wire (Redis Streams), and the publisher that sends them.

Torch-free and importable without redis: the trainer (rank 0 metrics), the worker (lifecycle,
logs) and the service (ingestion, SSE) all speak these records.

Layout (``prefix`` defaults to ``trainq``):

- ``{prefix}:events``            every job's events; the service ingests it through a consumer group
- ``{prefix}:job:{id}``          per-job copy for SSE followers (entry id = SSE id)
- ``{prefix}:hb:{id}:{attempt}`` heartbeat key with a TTL
- ``{prefix}:exited:{id}:{attempt}`` set by the worker in place of the heartbeat once its exit
  event is sent (with a TTL): the exit is in flight, the service's reaper waits for ingest
- ``{prefix}:claim:{id}:{attempt}`` the attempt's claim (SET NX), so a redelivery does nothing
- ``{prefix}:cancel:{id}``       cancel flag (the key is the truth; pub/sub only wakes)
- ``{prefix}:workers``           hash of live workers

A multi-node attempt has one task per node: node 0 uses the keys above, node ``n > 0`` the
same keys with ``:{n}`` appended (``hb:{id}:{attempt}:{n}``, ``claim:...:{n}``), so a
single-node job's keys are what they always were. The nodes meet in
``{prefix}:gang:{id}:{attempt}`` (worker.gang); ``{prefix}:stop:{id}:{attempt}`` tells the
nodes still running that the service already ended the attempt (another node failed).

An event is idempotent per ``(job, attempt, source, seq)``: each producer numbers its own
events per attempt, so a replay of the stream changes nothing. Node ``n``'s worker publishes
as source ``worker:{n}`` (node 0 as ``worker``) and numbers from ``n << NODE_SEQ_SHIFT``, so
``(job, attempt, seq)`` of worker events (the key of a stored log chunk) stays unique too.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

__all__ = [
    "EVENT_VERSION",
    "NODE_SEQ_SHIFT",
    "Event",
    "EventKind",
    "ExitCode",
    "Keys",
    "Publisher",
    "Reason",
    "worker_source",
]

log = logging.getLogger(__name__)

EVENT_VERSION = "1"

# Node n's worker numbers its events from n << NODE_SEQ_SHIFT (a run never sends 2**32).
NODE_SEQ_SHIFT = 32


def worker_source(node: int) -> str:
    """The ``source`` of node ``node``'s worker events: node 0 keeps the single-node name."""
    return "worker" if node == 0 else f"worker:{node}"


EventKind = Literal["lifecycle", "metric", "log", "status", "checkpoint"]
"""lifecycle: an attempt's phase (worker); metric: one step's numbers (trainer rank 0);
log: a batch of rank output lines (worker); status: a job status change (service, for SSE);
checkpoint: a checkpoint was written (trainer rank 0)."""

Reason = Literal[
    "spec_error",
    "exit_code",
    "oom",
    "nan_loss",
    "timeout",
    "lost",
    "preempted",
    "cancelled",
    "no_worker",
    "disk_full",
    "superseded",
]
REASONS: tuple[str, ...] = Reason.__args__  # type: ignore[attr-defined]


class ExitCode(IntEnum):
    """Exit codes of `python -m trainer` that carry a meaning beyond "it failed".

    torchrun folds a failed rank into its own exit status, so the trainer also writes
    ``exit.json`` into the run directory with the same reason; the worker reads that first.
    """

    OK = 0
    SPEC_ERROR = 64  # EX_USAGE: the config or the data cannot be used
    DATA_ERROR = 66  # EX_NOINPUT: data folder missing, shard corrupt
    NAN_LOSS = 75
    OOM = 76
    DISK_FULL = 77  # the run folder's file system has no room for a checkpoint
    SUPERSEDED = 78  # a newer attempt of the job was claimed (trainer.fence): no exit.json


@dataclass(frozen=True)
class Keys:
    prefix: str = "trainq"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def heartbeat(self, job_id: str, attempt: int, node: int = 0) -> str:
        return f"{self.prefix}:hb:{job_id}:{attempt}" + (f":{node}" if node else "")

    def exited(self, job_id: str, attempt: int, node: int = 0) -> str:
        """Replaces the heartbeat once the node's exit event is sent: the exit is in flight
        (not yet ingested), so the reaper must not take the missing heartbeat for a loss."""
        return f"{self.prefix}:exited:{job_id}:{attempt}" + (f":{node}" if node else "")

    def claim(self, job_id: str, attempt: int, node: int = 0) -> str:
        return f"{self.prefix}:claim:{job_id}:{attempt}" + (f":{node}" if node else "")

    def fence(self, job_id: str) -> str:
        """The job's newest claimed attempt and its published checkpoint (trainer.fence)."""
        return f"{self.prefix}:fence:{job_id}"

    def gang(self, job_id: str, attempt: int) -> str:
        return f"{self.prefix}:gang:{job_id}:{attempt}"

    def stop(self, job_id: str, attempt: int) -> str:
        return f"{self.prefix}:stop:{job_id}:{attempt}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    def preempt(self, job_id: str, attempt: int) -> str:
        """Set by the admitter: this attempt yields its capacity (checkpoint, exit)."""
        return f"{self.prefix}:preempt:{job_id}:{attempt}"

    @property
    def admit_channel(self) -> str:
        """Published when capacity may have changed: wakes the service's admitter."""
        return f"{self.prefix}:admit"

    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Event:
    kind: EventKind
    job_id: str
    attempt: int
    source: str  # "worker", "trainer" or "service"
    seq: int
    data: dict[str, Any]
    ts: float = field(default_factory=time.time)

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for XADD."""
        return {
            "v": EVENT_VERSION,
            "kind": self.kind,
            "job": self.job_id,
            "attempt": str(self.attempt),
            "src": self.source,
            "seq": str(self.seq),
            "ts": repr(self.ts),
            "data": json.dumps(self.data, separators=(",", ":"), allow_nan=False),
        }

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> Event:
        """Parse XREAD fields (bytes or str); ValueError on anything malformed."""
        f = {_text(k): _text(v) for k, v in fields.items()}
        try:
            kind = f["kind"]
            if kind not in ("lifecycle", "metric", "log", "status", "checkpoint"):
                raise ValueError(f"unknown event kind {kind!r}")
            data = json.loads(f["data"])
            if not isinstance(data, dict):
                raise ValueError("event data must be an object")
            return cls(
                kind=kind,  # type: ignore[arg-type]
                job_id=f["job"],
                attempt=int(f["attempt"]),
                source=f["src"],
                seq=int(f["seq"]),
                data=data,
                ts=float(f["ts"]),
            )
        except KeyError as exc:
            raise ValueError(f"event is missing field {exc.args[0]!r}") from exc

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.job_id, self.attempt, self.source, self.seq)


def clean_number(value: float | None) -> float | None:
    """NaN and inf are not JSON; a metric that is not finite travels as null."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(value)


def _bulk(value: str) -> bytes:
    b = value.encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


@functools.cache
def _bulk_name(name: str) -> bytes:
    return _bulk(name)


def _field_block(fields: dict[str, str]) -> bytes:
    """The field/value pairs of one XADD in RESP."""
    return b"".join([_bulk_name(k) + _bulk(v) for k, v in fields.items()])


@functools.lru_cache(maxsize=64)
def _xadd_head(key: str, maxlen: int, n_fields: int) -> bytes:
    """``XADD key MAXLEN ~ maxlen *`` in RESP, as the head of an array with the fields."""
    args = ("XADD", key, "MAXLEN", "~", str(maxlen), "*")
    return b"*%d\r\n" % (len(args) + 2 * n_fields) + b"".join(map(_bulk, args))


class Publisher:
    """Sends events to Redis from a background thread; never blocks or fails the caller.

    Events are appended to ``{prefix}:events`` and to the job's own stream in one MULTI, in
    the order they were emitted. While Redis is unreachable they are kept (up to
    ``max_buffer``; past that the oldest metric events are dropped first, with a warning)
    and sent in order when it returns. An event that follows a quiet spell goes out at once;
    a steady stream (a metric every few ms) is coalesced into at most one round trip per
    ``min_interval_s``, and ``emit()`` wakes the sender only when it has work to start, so
    reporting costs the training loop almost no CPU or GIL time. ``close()`` flushes what it
    can within a timeout.
    """

    def __init__(
        self,
        url: str,
        job_id: str,
        attempt: int,
        source: str,
        *,
        prefix: str = "trainq",
        job_stream_maxlen: int = 10_000,
        events_maxlen: int = 1_000_000,
        max_buffer: int = 200_000,
        retry_s: float = 0.5,
        min_interval_s: float = 0.2,
        batch_max: int = 256,
        seq_start: int = 0,
    ) -> None:
        self.keys = Keys(prefix)
        self.job_id = job_id
        self.attempt = attempt
        self.source = source
        self._url = url
        self._job_maxlen = job_stream_maxlen
        self._events_maxlen = events_maxlen
        self._max_buffer = max_buffer
        self._retry_s = retry_s
        self._min_interval_s = min_interval_s
        self._batch_max = batch_max
        self._last_send = -1e9
        self._flushers = 0
        self._idle = False  # the sender waits with no timeout; emit() must wake it
        self._queue: deque[Event] = deque()
        self._cond = threading.Condition()
        self._seq = seq_start  # the first event is seq_start + 1
        self._closing = False
        self._conn: Any = None  # a redis.connection.Connection, made on first use
        self._link_down = False  # the last send failed; cleared by the next one that works
        self.sent = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"publish-{source}", daemon=True)
        self._thread.start()

    def emit(self, kind: EventKind, data: dict[str, Any]) -> Event:
        with self._cond:
            self._seq += 1
            event = Event(kind, self.job_id, self.attempt, self.source, self._seq, data)
            self._queue.append(event)
            n = len(self._queue)
            if n > self._max_buffer:
                self._drop_one()
            # Wake the sender only where it sleeps with no end (idle: nothing sent for a whole
            # interval) or for a full batch; within an interval it wakes by itself at the end,
            # so a steady stream costs one wake-up per send, none per step. notify_all: a
            # flush() waiter shares the condition, and a lone notify() could wake it instead.
            if (n == 1 and self._idle) or n == self._batch_max:
                self._cond.notify_all()
        return event

    def _drop_one(self) -> None:
        for i, ev in enumerate(self._queue):
            if ev.kind == "metric":
                del self._queue[i]
                break
        else:
            self._queue.popleft()
        self.dropped += 1
        if self.dropped in (1, 100, 10_000):
            log.warning("event buffer full while Redis is unreachable; dropped %d", self.dropped)

    @property
    def link_down(self) -> bool:
        """The last send failed (Redis unreachable); False again after the next one works."""
        return self._link_down

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _connect(self) -> Any:
        """The publisher's own connection (redis-py's: URL, auth, db, TLS, timeouts)."""
        if self._conn is None:
            import redis

            pool = redis.ConnectionPool.from_url(
                self._url, socket_timeout=5, socket_connect_timeout=2
            )
            self._conn = pool.get_connection()
        return self._conn

    def _send(self, batch: list[Event]) -> None:
        """One MULTI of XADDs to both streams, packed here and sent in one write.

        redis-py's pipeline packs every argument through generic Python code: for a batch of
        ten metrics that was ~1 ms of CPU, with the GIL held, in the training process (rank
        0), 5 times a second. Here each event's field block is encoded once and shared by
        both XADDs; redis-py still owns the connection and parses the replies.
        """
        conn = self._connect()
        try:
            conn.send_packed_command([self._packed(batch)])
            for _ in range(1 + 2 * len(batch)):  # MULTI's +OK, then +QUEUED for each XADD
                conn.read_response()
            replies = conn.read_response()  # EXEC: the entry ids, or errors
        except BaseException:
            conn.disconnect()  # replies may be left unread: start clean next time
            raise
        errors = [r for r in replies or () if isinstance(r, Exception)]
        if errors:
            raise errors[0]

    def _packed(self, batch: list[Event]) -> bytes:
        parts = [b"*1\r\n$5\r\nMULTI\r\n"]
        for ev in batch:
            fields = ev.to_fields()
            body, n = _field_block(fields), len(fields)
            parts += (
                _xadd_head(self.keys.events, self._events_maxlen, n),
                body,
                _xadd_head(self.keys.job(ev.job_id), self._job_maxlen, n),
                body,
            )
        parts.append(b"*1\r\n$4\r\nEXEC\r\n")
        return b"".join(parts)

    def _run(self) -> None:
        # Connect before the first event: a run's first metric then costs one round trip,
        # not the import of redis and a TCP connect while the user waits for it.
        try:
            self._connect().connect()
        except Exception as exc:  # unreachable now: the first send retries
            log.debug("publisher could not connect yet (%s)", exc)
            self._link_down = True
        while True:
            with self._cond:
                # At most one round trip per interval: a fast producer (a step every few ms)
                # shares it among many events, while an event after a quiet spell goes at once.
                while True:
                    n = len(self._queue)
                    if not n and self._closing:
                        return
                    if n and (n >= self._batch_max or self._closing or self._flushers):
                        break
                    left = self._last_send + self._min_interval_s - time.monotonic()
                    if n and left <= 0:
                        break
                    # Within the interval, sleep to its end (what arrives waits for it anyway);
                    # after it, with nothing to send, until emit() wakes us.
                    self._idle = left <= 0
                    self._cond.wait(None if self._idle else left)
                self._idle = False
                batch = [self._queue[i] for i in range(min(len(self._queue), self._batch_max))]
                self._last_send = time.monotonic()
            try:
                self._send(batch)
            except Exception as exc:  # redis.ConnectionError, TimeoutError, ...: keep and retry
                log.debug("publish failed (%s); retrying", exc)
                with self._cond:
                    self._link_down = True
                    give_up = self._give_up_at
                    if self._closing and give_up is not None and time.monotonic() >= give_up:
                        return
                    self._cond.wait(self._retry_s)
                continue
            with self._cond:
                # Only the sender pops, so the first len(batch) entries are still this batch,
                # unless _drop_one removed some while we sent: drop by identity.
                sent_ids = {id(ev) for ev in batch}
                while self._queue and id(self._queue[0]) in sent_ids:
                    self._queue.popleft()
                self.sent += len(batch)
                self._link_down = False
                self._cond.notify_all()

    _give_up_at: float | None = None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything emitted so far is sent; False if the timeout passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushers += 1  # the sender skips its interval while someone waits here
            self._cond.notify_all()
            try:
                while self._queue:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.1))
            finally:
                self._flushers -= 1
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Flush within the timeout, then stop the thread. True if nothing was left unsent."""
        with self._cond:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 1)
        ok = not self._queue
        if self._conn is not None:
            try:
                self._conn.disconnect()
            except Exception:
                pass
        return ok
