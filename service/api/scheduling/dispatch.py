"""Hands committed attempts to Celery by task name; the service never imports the worker.

A job row is committed first and sent second. If sending fails (broker down), the attempt
stays ``dispatched`` with ``sent_at`` null and the reconciler sends it later; a duplicate
send is harmless because the worker claims each attempt with ``SET NX``. After a failure,
requests skip sending for ``dispatch_backoff_s`` so a dead broker does not slow every POST.

A job of N nodes is sent as N messages per attempt, one per ``node_rank``; the attempt
counts as sent once all N are, and a resend sends all N again (each node claims its own
``(job, attempt, node)``, so the nodes that already run ignore theirs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.models import ATTEMPTS, JOBS, utcnow
from service.api.core.settings import Settings
from trainer.events import Keys
from worker.message import TASK_NAME, JobMessage, broker_queue, message_tag, worker_queue

__all__ = ["Dispatcher", "dispatch_attempts", "job_message"]

log = logging.getLogger(__name__)


class _Unsent(Exception):
    """``send`` failed inside ``send_batch`` (and logged why)."""


class Dispatcher:
    """A minimal Celery client: ``send_task`` only, created on first use (Celery is slow to
    import, and most processes that load ``service`` never send)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._celery: Any = None
        self._lock = threading.Lock()
        self._failed_at = 0.0
        self._batch = threading.local()  # send_batch's producer, which send() then uses
        self._broker: Any = None
        self._events: Any = None
        self.admit_wake = threading.Event()  # the local admitter's (service.api.scheduling.admit)

    def _app(self) -> Any:
        with self._lock:
            if self._celery is None:
                import celery

                app = celery.Celery("trainq-service", broker=self._settings.broker_url)
                timeout = self._settings.redis_timeout_s
                app.conf.update(
                    task_serializer="json",
                    accept_content=["json"],
                    task_ignore_result=True,
                    broker_connection_timeout=timeout,
                    broker_connection_retry_on_startup=False,
                    broker_transport_options={
                        "socket_connect_timeout": timeout,
                        "socket_timeout": timeout,
                        # Fail at once: an unsent attempt is the reconciler's to resend.
                        "max_retries": 0,
                    },
                )
                self._celery = app
            return self._celery

    def wake(self) -> None:
        """Ask the admitter for a pass: this process's (an event) and every replica's (the
        admit channel). Best effort: the periodic pass comes anyway."""
        if not self.admits:
            return
        self.admit_wake.set()
        try:
            self._client("_events", self._settings.redis_url).publish(
                Keys(self._settings.redis_prefix).admit_channel, "1"
            )
        except Exception as exc:  # Redis away: the periodic pass places the job
            log.debug("admitter wake-up not published: %s", exc)

    @property
    def admits(self) -> bool:
        """Jobs wait for the admitter (``scheduler=admit``), not sent at submit."""
        return self._settings.scheduler == "admit"

    @property
    def backing_off(self) -> bool:
        return time.monotonic() - self._failed_at < self._settings.dispatch_backoff_s

    def send(self, message: JobMessage, worker: str | None = None) -> bool:
        """Publish one node of an attempt to its queue's shared list, or to ``worker``'s own
        queue (the admitter's choice); False (logged) if the broker did not take it."""
        prefix = self._settings.redis_prefix
        queue = (
            broker_queue(message.queue, prefix) if worker is None else worker_queue(worker, prefix)
        )
        try:
            self._app().send_task(
                TASK_NAME,
                args=[message.to_json()],
                queue=queue,
                retry=False,
                producer=getattr(self._batch, "producer", None),
                # Celery would saferepr() the whole spec for these headers: a third of a send.
                # The tag is also how the reconciler finds the message in its queue.
                argsrepr=message_tag(message.job_id, message.attempt, message.node_rank),
                kwargsrepr="{}",
            )
        except Exception as exc:  # kombu OperationalError, redis errors, OSError
            self._failed_at = time.monotonic()
            log.warning(
                "send of job %s attempt %d failed: %s", message.job_id, message.attempt, exc
            )
            return False
        self._failed_at = 0.0
        return True

    def send_placed(self, row: Mapping[Any, Any], attempt: int, placement: list[str]) -> bool:
        """Send each node of an admitted attempt to the worker placed for it."""
        return all(
            self.send(job_message(row, attempt, n), worker=placement[n])
            for n in range(int(row["nodes"]))
        )

    def broker_client(self) -> Any:
        """A plain Redis client on the broker database (to read or trim its lists)."""
        return self._client("_broker", self._settings.broker_url)

    def _client(self, attr: str, url: str) -> Any:
        with self._lock:
            if getattr(self, attr) is None:
                import redis

                timeout = self._settings.redis_timeout_s
                setattr(
                    self,
                    attr,
                    redis.Redis.from_url(
                        url, socket_timeout=timeout, socket_connect_timeout=timeout
                    ),
                )
            return getattr(self, attr)

    def send_attempt(self, row: Mapping[Any, Any], attempt: int) -> bool:
        """Send one attempt of a job row: a message per node; False at the first refused."""
        return all(self.send(job_message(row, attempt, n)) for n in range(int(row["nodes"])))

    def send_batch(self, rows: Iterable[Mapping[Any, Any]], attempt: int) -> int:
        """``send_attempt`` of each row, in one pipelined write to the broker (kombu's
        publish batch); how many rows went out, in order. A failed write counts as none,
        since delivery is then uncertain (the reconciler resends; the worker's claim drops
        a duplicate)."""
        count = 0
        batch = None
        try:
            with self._app().producer_or_acquire() as producer:
                batch = getattr(producer, "batch", None)  # kombu >= 5.7; else one by one
                with batch() if batch is not None else contextlib.nullcontext():
                    self._batch.producer = producer
                    try:
                        for row in rows:
                            if not self.send_attempt(row, attempt):
                                raise _Unsent  # discards what the batch holds
                            count += 1
                    finally:
                        del self._batch.producer
        except Exception as exc:  # kombu's BatchPublishError, redis errors, OSError
            self._failed_at = time.monotonic()
            if not isinstance(exc, _Unsent):
                log.warning("send of %d attempts failed: %s", count, exc)
            return 0 if batch is not None else count
        return count

    def close(self) -> None:
        with self._lock:
            for attr in ("_broker", "_events"):
                client = getattr(self, attr)
                if client is not None:
                    client.close()
                    setattr(self, attr, None)
            if self._celery is not None:
                self._celery.close()
                self._celery = None


def job_message(row: Mapping[Any, Any], attempt: int, node_rank: int = 0) -> JobMessage:
    """The frozen message of one node of one attempt, from a job row (its columns)."""
    return JobMessage.model_validate(
        {
            "job_id": row["id"],
            "attempt": attempt,
            "queue": row["queue"],
            "nodes": row["nodes"],
            "procs_per_node": row["procs_per_node"],
            "node_rank": node_rank,
            "max_runtime_s": row["max_runtime_s"],
            "owner": row.get("owner"),
            "train": row["train"],
        }
    )


def dispatch_attempts(
    sessions: sessionmaker[Session], dispatcher: Dispatcher, pairs: Iterable[tuple[str, int]]
) -> int:
    """Send each (job id, attempt) that is still queued and unsent; mark the sent ones."""
    pairs = list(pairs)
    if not pairs:
        return 0
    ids = sorted({job_id for job_id, _ in pairs})
    with sessions() as session:
        rows = {
            r.id: r
            for r in session.execute(
                select(
                    JOBS.c.id,
                    JOBS.c.queue,
                    JOBS.c.nodes,
                    JOBS.c.procs_per_node,
                    JOBS.c.max_runtime_s,
                    JOBS.c.owner,
                    JOBS.c.train,
                    JOBS.c.status,
                    JOBS.c.attempt,
                    ATTEMPTS.c.placement,
                )
                .join(
                    ATTEMPTS,
                    and_(ATTEMPTS.c.job_id == JOBS.c.id, ATTEMPTS.c.number == JOBS.c.attempt),
                )
                .where(JOBS.c.id.in_(ids))
            )
        }
    admit = dispatcher.admits
    sent: list[tuple[str, int]] = []
    for job_id, number in pairs:
        row = rows.get(job_id)
        if row is None or row.status != "queued" or row.attempt != number:
            continue  # cancelled or moved on since the caller decided to send
        if row.placement:
            ok = dispatcher.send_placed(row._mapping, number, list(row.placement))
        elif admit:
            continue  # waits for the admitter (service.api.scheduling.admit), which sends it
        else:
            ok = dispatcher.send_attempt(row._mapping, number)
        if ok:
            sent.append((job_id, number))
        else:
            break  # the broker is down: the reconciler sends the rest later
    if sent:
        with sessions() as session, session.begin():
            now = utcnow()
            for job_id, number in sent:
                session.execute(
                    update(ATTEMPTS)
                    .where(ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.number == number)
                    .values(sent_at=now)
                )
    return len(sent)
