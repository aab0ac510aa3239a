"""The ingestor: applies what workers and trainer ranks stream back to the SQL store.

It reads ``Keys.events`` through a consumer group, so API replicas share the work. One batch
is one transaction: lifecycle events go through ``service.api.jobs.state`` (compare-and-set, so a
replay changes nothing), metrics and logs are batch-inserted with ON CONFLICT DO NOTHING on
their natural keys. Entries are acked only after the commit; on start, and after any failure,
the consumer's own pending entries are read again first, and entries a dead consumer left
pending are claimed (XAUTOCLAIM) once idle long enough, so a crash loses nothing.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.db import insert_for
from service.api.core.models import ATTEMPTS, JOBS, LOGS, METRICS
from service.api.core.settings import Settings
from service.api.events.record import record_job_event
from service.api.jobs.state import Outcome, attempt_exited, attempt_running
from service.api.scheduling.dispatch import Dispatcher, dispatch_attempts
from service.api.streams.notify import StopSignals, publish_status
from service.api.streams.schemas import METRIC_FIELDS
from trainer.events import REASONS, Event, Keys

__all__ = ["Ingestor", "clean_log_lines", "clean_metric"]

log = logging.getLogger(__name__)

LATEST_FIELDS = ("steps", "loss", "val_loss", "tokens_per_s", "mfu")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def clean_metric(data: dict[str, Any]) -> dict[str, Any] | None:
    """The known fields of a metric event, as numbers or null; None if it has no step."""
    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**31:
        return None
    out: dict[str, Any] = {}
    for name in METRIC_FIELDS:
        value = _number(data.get(name))
        if name == "steps" and value is not None:
            value = int(value) if 0 <= value < 2**31 else None
        out[name] = value
    out["step"] = step
    return out


def clean_log_lines(data: dict[str, Any], max_lines: int, max_chars: int) -> list[dict[str, Any]]:
    lines = data.get("lines")
    if not isinstance(lines, list):
        return []
    out = []
    for item in lines[:max_lines]:
        if not isinstance(item, dict):
            continue
        rank = item.get("rank")
        text = item.get("line")
        if not isinstance(text, str):
            continue
        line = {
            "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            "stream": "stderr" if item.get("stream") == "stderr" else "stdout",
            "line": text if len(text) <= max_chars else text[:max_chars] + "…",
        }
        node = item.get("node")  # multi-node attempts only
        if isinstance(node, int) and not isinstance(node, bool):
            line["node"] = node
        out.append(line)
    return out


def _when(ts: float) -> datetime:
    try:
        return datetime.fromtimestamp(ts, UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.now(UTC)


class Ingestor:
    """One consumer of the events stream; ``run_once`` is one batch, ``run`` loops."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis: Any,
        dispatcher: Dispatcher,
        *,
        consumer: str | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis
        self.dispatcher = dispatcher
        # Admission requeues a gang that failed to start, after a backoff (state._settle).
        self._gang_backoff = (
            (settings.gang_backoff_s, settings.gang_backoff_max_s)
            if settings.scheduler == "admit"
            else None
        )
        self.keys = Keys(settings.redis_prefix)
        self.stops = StopSignals(redis, self.keys)
        self.group = settings.consumer_group
        self.consumer = consumer or settings.consumer_name
        self._read_own_pending = True  # first our own PEL: what we read but never acked
        self._next_claim = 0.0
        self._group_ready = False
        self.applied = 0
        self.dropped = 0  # events of an attempt sent after it was called lost
        self.last_event_ts: float | None = None

    def ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.redis.xgroup_create(self.keys.events, self.group, id="0", mkstream=True)
        except Exception as exc:  # redis.ResponseError BUSYGROUP: it exists, which is fine
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _read(self, block_ms: int | None) -> list[tuple[Any, Any]]:
        batch = self.settings.ingest_batch
        if self._read_own_pending:
            resp = self.redis.xreadgroup(
                self.group, self.consumer, {self.keys.events: "0"}, count=batch
            )
            entries = resp[0][1] if resp else []
            if entries:
                return list(entries)
            self._read_own_pending = False
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + max(1.0, self.settings.ingest_claim_idle_ms / 4000)
            claimed = self.redis.xautoclaim(
                self.keys.events,
                self.group,
                self.consumer,
                min_idle_time=self.settings.ingest_claim_idle_ms,
                start_id="0-0",
                count=batch,
            )
            entries = [e for e in claimed[1] if e is not None]
            if entries:
                return list(entries)
        entries = self._new(batch, block_ms)
        # A read that may not block (block_ms None: apply what is there now) does not linger.
        return self._linger(entries) if entries and block_ms is not None else entries

    def _new(self, count: int, block_ms: int | None) -> list[tuple[Any, Any]]:
        """Up to ``count`` entries no consumer of the group was given yet, waiting up to
        ``block_ms`` for the first (None: not at all). The wait is kept within half the Redis
        client's socket timeout (``redis_timeout_s``): a longer one would end in a timeout
        error, not in no entries."""
        if block_ms is not None:
            block_ms = max(1, min(block_ms, int(self.settings.redis_timeout_s * 500)))
        resp = self.redis.xreadgroup(
            self.group, self.consumer, {self.keys.events: ">"}, count=count, block=block_ms
        )
        return list(resp[0][1]) if resp else []

    def _linger(self, entries: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """More new entries for the same transaction, while they are all metrics and logs,
        for up to ``ingest_linger_ms`` after the first.

        A run streams a metric batch from rank 0 and a log batch from each node several
        times a second; each became a transaction of its own (the jobs row, the lost
        attempts, the inserts, the latest-metrics update), ~2 ms of API CPU and a commit
        per entry, taken on a small host from the ranks. Here they share one per linger.
        A waiting read wakes at each entry, and returns at once when one is anything but a
        metric or a log (a lifecycle change, a checkpoint): those are never held back.
        """
        batch = self.settings.ingest_batch
        deadline = time.monotonic() + self.settings.ingest_linger_ms / 1000
        new = entries
        while len(entries) < batch and not any(_urgent(fields) for _, fields in new):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            new = self._new(batch - len(entries), left_ms)
            entries.extend(new)
        return entries

    def run_once(self, block_ms: int | None = None) -> int:
        """Read one batch and apply it; the number of entries handled (0: nothing came)."""
        self.ensure_group()
        self.stops.send()  # what an earlier batch could not say (Redis failed after its commit)
        entries = self._read(block_ms)
        if not entries:
            return 0
        try:
            self.apply(entries)
        except Exception:
            self._read_own_pending = True  # not acked: read them again next time
            raise
        return len(entries)

    def apply(self, entries: list[tuple[Any, Any]]) -> None:
        ids = [entry_id for entry_id, _ in entries]
        events: list[Event] = []
        for entry_id, fields in entries:
            if not fields:
                continue  # trimmed while pending
            try:
                events.append(Event.from_fields(fields))
            except (ValueError, TypeError) as exc:
                log.warning("dropping malformed event %r: %s", entry_id, exc)
        try:
            outcome = self._commit(events)
        except (OperationalError, DBAPIError) as exc:
            if isinstance(exc, OperationalError) or exc.connection_invalidated:
                raise  # the database is away: keep the batch pending, try it again later
            log.warning("batch failed (%s); applying its events one by one", exc)
            outcome = Outcome()
            for ev in events:
                try:
                    outcome.extend(self._commit([ev]))
                except (OperationalError, DBAPIError) as one_exc:
                    if isinstance(one_exc, OperationalError):
                        raise
                    log.warning("dropping event %s that the store refuses: %s", ev.key, one_exc)
        publish_status(
            self.redis, self.keys, outcome.changes, maxlen=self.settings.job_stream_maxlen
        )
        self.stops.send(outcome.to_stop)
        if outcome.to_send:
            dispatch_attempts(self.sessions, self.dispatcher, outcome.to_send)
        if any(ev.kind == "lifecycle" for ev in events):
            self.dispatcher.wake()  # an attempt started or ended: capacity changed
        self.redis.xack(self.keys.events, self.group, *ids)
        self.applied += len(events)
        if events:
            self.last_event_ts = max(ev.ts for ev in events)

    def _commit(self, events: list[Event]) -> Outcome:
        outcome = Outcome()
        if not events:
            return outcome
        with self.sessions() as session, session.begin():
            job_ids = {ev.job_id for ev in events}
            known = {
                r.id: r
                for r in session.execute(
                    select(
                        JOBS.c.id, JOBS.c.metric_attempt, JOBS.c.last_step, JOBS.c.last_metrics
                    ).where(JOBS.c.id.in_(job_ids))
                )
            }
            metrics: dict[tuple[str, int, int], dict[str, Any]] = {}
            logs: dict[tuple[str, int, int], dict[str, Any]] = {}
            superseded = _lost_since(session, job_ids)
            for ev in events:
                if ev.job_id not in known:
                    continue  # a job this store never had (another deployment's prefix?)
                ended = superseded.get((ev.job_id, ev.attempt))
                if ended is not None and ev.ts > ended and ev.kind in ("metric", "log"):
                    # Sent after the service called its attempt lost: a host that was cut off
                    # and came back (trainer.fence stops it at its next checkpoint).
                    self.dropped += 1
                    continue
                if ev.kind == "metric":
                    point = clean_metric(ev.data)
                    if point is not None:
                        step = point.pop("step")
                        key = (ev.job_id, ev.attempt, step)
                        metrics[key] = {
                            "job_id": ev.job_id,
                            "attempt": ev.attempt,
                            "step": step,
                            "ts": ev.ts,
                            "data": point,
                        }
                elif ev.kind == "log":
                    lines = clean_log_lines(
                        ev.data, self.settings.log_chunk_max_lines, self.settings.log_line_max_chars
                    )
                    if lines:
                        logs[(ev.job_id, ev.attempt, ev.seq)] = {
                            "job_id": ev.job_id,
                            "attempt": ev.attempt,
                            "seq": ev.seq,
                            "ts": ev.ts,
                            "lines": lines,
                        }
                elif ev.kind == "lifecycle":
                    outcome.extend(self._lifecycle(session, ev))
                elif ev.kind == "checkpoint":
                    _checkpoint_written(session, ev)
            insert = insert_for(session)
            if metrics:
                session.execute(
                    insert(METRICS).on_conflict_do_nothing(
                        index_elements=["job_id", "attempt", "step"]
                    ),
                    list(metrics.values()),
                )
                self._update_latest(session, known, metrics.values())
            if logs:
                session.execute(
                    insert(LOGS).on_conflict_do_nothing(
                        index_elements=["job_id", "attempt", "seq"]
                    ),
                    list(logs.values()),
                )
        return outcome

    def _lifecycle(self, session: Session, ev: Event) -> Outcome:
        data = ev.data
        phase = data.get("phase")
        at = _when(ev.ts)
        if phase == "running":
            pid = data.get("pid")
            return attempt_running(
                session,
                ev.job_id,
                ev.attempt,
                host=_short(data.get("host")),
                worker=_short(data.get("worker")),
                pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                at=at,
            )
        if phase == "exited":
            code = data.get("exit_code")
            exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
            reason = data.get("reason")
            message = data.get("message")
            text = message[:4000] if isinstance(message, str) else ""
            if reason is not None and reason not in REASONS:
                text = f"unknown reason {str(reason)[:40]!r}: {text}"
                reason = "exit_code"
            node = data.get("node")  # set by each node of a multi-node attempt
            return attempt_exited(
                session,
                ev.job_id,
                ev.attempt,
                exit_code=exit_code,
                reason=reason,
                message=text,
                node=node if isinstance(node, int) and not isinstance(node, bool) else None,
                at=at,
                gang_backoff=self._gang_backoff,
            )
        log.debug("ignoring lifecycle phase %r of %s", phase, ev.key)
        return Outcome()

    @staticmethod
    def _update_latest(
        session: Session, known: dict[str, Any], points: Iterable[dict[str, Any]]
    ) -> None:
        newest: dict[str, dict[str, Any]] = {}
        evals: dict[str, dict[str, Any]] = {}  # eval runs every N steps: keep the last one
        for p in points:
            for best, wanted in ((newest, True), (evals, p["data"].get("val_loss") is not None)):
                cur = best.get(p["job_id"])
                if wanted and (
                    cur is None or (p["attempt"], p["step"]) >= (cur["attempt"], cur["step"])
                ):
                    best[p["job_id"]] = p
        for job_id, p in newest.items():
            row = known[job_id]
            if row.metric_attempt is not None and (row.metric_attempt, row.last_step) > (
                p["attempt"],
                p["step"],
            ):
                continue
            latest = {name: p["data"].get(name) for name in LATEST_FIELDS}
            if latest["val_loss"] is None:
                if p["job_id"] in evals:
                    latest["val_loss"] = evals[p["job_id"]]["data"]["val_loss"]
                elif row.last_metrics:
                    latest["val_loss"] = row.last_metrics.get("val_loss")
            latest["step"] = p["step"]
            session.execute(
                update(JOBS)
                .where(
                    JOBS.c.id == job_id,
                    or_(
                        JOBS.c.metric_attempt.is_(None),
                        JOBS.c.metric_attempt < p["attempt"],
                        and_(JOBS.c.metric_attempt == p["attempt"], JOBS.c.last_step <= p["step"]),
                    ),
                )
                .values(metric_attempt=p["attempt"], last_step=p["step"], last_metrics=latest)
            )

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set; outages are logged and retried, never fatal."""
        backoff = 0.5
        while not stop.is_set():
            try:
                self.run_once(block_ms=self.settings.ingest_block_ms)
                backoff = 0.5
            except Exception as exc:  # Redis or the database away: wait and try again
                self._group_ready = False
                log.warning("ingest: %s; retrying in %.1fs", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)


_TELEMETRY = (b"metric", b"log", "metric", "log")


def _urgent(fields: Any) -> bool:
    """An entry that must not wait for company: anything but a metric or a log."""
    if not fields:
        return False  # trimmed while pending: nothing to apply
    kind = fields.get(b"kind", fields.get("kind"))
    return kind not in _TELEMETRY


def _lost_since(session: Session, job_ids: set[str]) -> dict[tuple[str, int], float]:
    """(job, attempt) -> when the service called it lost (its heartbeat expired)."""
    rows = session.execute(
        select(ATTEMPTS.c.job_id, ATTEMPTS.c.number, ATTEMPTS.c.ended_at).where(
            ATTEMPTS.c.job_id.in_(job_ids), ATTEMPTS.c.status == "lost"
        )
    )
    out = {}
    for r in rows:
        if r.ended_at is not None:
            at = r.ended_at if r.ended_at.tzinfo else r.ended_at.replace(tzinfo=UTC)
            out[(r.job_id, r.number)] = at.timestamp()
    return out


_CHECKPOINT = re.compile(r"step-[0-9]{1,10}")


def _checkpoint_written(session: Session, ev: Event) -> None:
    """Rank 0 wrote a checkpoint: ``checkpoint.written`` in the outbox, once per attempt and
    step however often the stream is replayed."""
    step, name = ev.data.get("step"), ev.data.get("checkpoint")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**31:
        return
    if not isinstance(name, str) or not _CHECKPOINT.fullmatch(name):
        return
    data = {"job_id": ev.job_id, "attempt": ev.attempt, "step": step, "checkpoint": name}
    record_job_event(
        session, type="checkpoint.written", job_id=ev.job_id, data=data,
        key=f"checkpoint:{ev.job_id}:{ev.attempt}:{step}",
    )  # fmt: skip


def _short(value: Any) -> str | None:
    return value[:255] if isinstance(value, str) else None
