"""The reconciler: repairs what the happy path can miss. One pass at a time across all API
replicas (a Redis lock with a token, released only by its holder).

- Attempts committed but never handed to Celery (the broker was down, the process died
  between commit and send) are sent again.
- An attempt that a worker claimed, or that reported running, whose heartbeat key has been
  gone for ``heartbeat_grace_s`` is ``lost`` (a multi-node attempt: the heartbeat of any
  node that claimed it, or of any node of a running one, that has not reported its exit);
  ``service.api.jobs.state`` then retries the job with a new attempt in the same run directory (the
  trainer resumes from its checkpoint) while retries remain, else fails it with reason
  ``lost``. A worker that has sent a node's exit event replaces its heartbeat by an
  ``exited`` marker with a long TTL (one transaction, worker.watchers.Heartbeat.hand_over),
  so an exit that ingest has not applied yet (an API under load, ingest lagging past the
  grace) is never mistaken for a loss; the grace only covers beats that come late.
- An attempt that was sent but that no worker claimed, and whose message is in no broker
  queue, is sent again (``resend_orphaned``, every ``orphan_check_s``): the broker lost its
  data (a Redis restart without persistence, a flush), or a worker died holding the
  message. The store is the truth, the broker only carries; the worker's claim makes a
  duplicate harmless. Seen missing on two checks in a row, so a message that a worker has
  just taken and not yet claimed is not mistaken for a lost one.
- A dataset left ``uploading`` or ``preparing`` by an API process that stopped beating for
  ``dataset_stale_s`` is failed with a reason, and its work files removed
  (``service.api.datasets.service.reap_stale``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import UTC, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.models import ATTEMPTS, JOBS, utcnow
from service.api.core.settings import Settings
from service.api.datasets.service import reap_stale
from service.api.jobs.state import Outcome, attempt_lost
from service.api.scheduling.dispatch import Dispatcher, dispatch_attempts
from service.api.scheduling.passlock import StorePass, one_pass
from service.api.streams.notify import StopSignals, publish_status
from worker.message import broker_queue, worker_queue

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)


# Dispatched attempts checked per pass for a claim without a heartbeat (a worker that died
# between claiming and launching); a long queue is walked over several passes.
DISPATCHED_WINDOW = 2000

# Sent attempts checked per orphan check (oldest first).
ORPHAN_WINDOW = 5000
BROKER_CHUNK = 1000
# The tag worker.message.message_tag writes in each message's headers.
_TAG = re.compile(rb"\(job ([0-9a-f]{1,64}) attempt ([0-9]{1,9}) node ([0-9]{1,9})\)")


class Reconciler(StorePass):
    lock_name = "reconcile"

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis: Any,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__(settings, sessions, redis, dispatcher)
        self._dispatched_after = 0
        self._suspects: set[tuple[str, int]] = set()
        self._orphans_at = 0.0
        self.stops = StopSignals(redis, self.keys)

    def run_once(self, *, orphans: bool = False) -> dict[str, int] | None:
        """One pass, if no other replica holds the lock; counts of what it did, else None.
        ``orphans``: also look for sent attempts whose message the broker lost."""
        ttl_s = max(10.0, self.settings.reconcile_interval_s * 5)
        self.stops.send()  # what an earlier pass could not say (idempotent: any replica)
        with one_pass(self.redis, self.lock_key, ttl_s) as mine:
            if not mine:
                return None
            done = {"sent": self.resend_unsent(), "lost": self.reap_lost()}
            # Datasets whose uploading/preparing API process died (service.api.datasets.service).
            reap_stale(self.sessions, self.settings.data_root, self.settings.dataset_stale_s)
            if orphans:
                done["orphaned"] = self.resend_orphaned()
            return done

    def _queued_tags(self, name: str) -> set[tuple[str, int, int]] | None:
        """(job, attempt, node) of every message waiting in broker list ``name``; None if
        the list is longer than ``orphan_scan_max`` (then nothing can be concluded)."""
        broker = self.dispatcher.broker_client()
        if broker.llen(name) > self.settings.orphan_scan_max:
            log.warning("reconcile: queue %s is too long to check for lost messages", name)
            return None
        tags: set[tuple[str, int, int]] = set()
        start = 0
        while True:
            chunk = broker.lrange(name, start, start + BROKER_CHUNK - 1)
            for raw in chunk:
                m = _TAG.search(raw)
                if m:
                    tags.add((m.group(1).decode(), int(m.group(2)), int(m.group(3))))
            if len(chunk) < BROKER_CHUNK:
                return tags
            start += BROKER_CHUNK

    def resend_orphaned(self) -> int:
        """Send again the sent, unclaimed attempts whose message is in no broker queue."""
        cutoff = utcnow() - timedelta(seconds=self.settings.unsent_grace_s)
        with self.sessions() as session:
            rows = list(
                session.execute(
                    _waiting(
                        ATTEMPTS.c.job_id,
                        ATTEMPTS.c.number,
                        JOBS.c.queue,
                        JOBS.c.nodes,
                        ATTEMPTS.c.placement,
                    )
                    .where(ATTEMPTS.c.sent_at.is_not(None), ATTEMPTS.c.sent_at <= cutoff)
                    .order_by(ATTEMPTS.c.id)
                    .limit(ORPHAN_WINDOW)
                )
            )
        pipe = self.redis.pipeline(transaction=False)
        for r in rows:
            for n in range(r.nodes or 1):
                pipe.exists(self.keys.claim(r.job_id, r.number, n))
        answers = iter(pipe.execute() if rows else ())
        prefix = self.settings.redis_prefix
        unclaimed: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for r in rows:
            # Each node's message is in its worker's own queue (placed by the admitter), or
            # in the queue's shared list (the fifo scheduler).
            nodes = [
                (
                    worker_queue(r.placement[n], prefix)
                    if r.placement
                    else broker_queue(r.queue, prefix),
                    n,
                )
                for n in range(r.nodes or 1)
                if not next(answers)
            ]
            if nodes:
                unclaimed[(r.job_id, r.number)] = nodes
        names = sorted({name for nodes in unclaimed.values() for name, _ in nodes})
        waiting = {name: self._queued_tags(name) for name in names}
        missing = set()
        for (job_id, number), nodes in unclaimed.items():
            for name, n in nodes:
                tags = waiting[name]
                if tags is not None and (job_id, number, n) not in tags:
                    missing.add((job_id, number))
        orphans = sorted(missing & self._suspects)
        self._suspects = missing - set(orphans)
        for job_id, number in orphans:
            log.warning(
                "job %s attempt %d: sent, claimed by no worker, and in no broker queue"
                " (the broker lost it); sending it again",
                job_id,
                number,
            )
        return dispatch_attempts(self.sessions, self.dispatcher, orphans)

    def resend_unsent(self) -> int:
        if self.dispatcher.admits:
            return 0  # the admitter sends what it placed, and again if a send failed
        cutoff = utcnow() - timedelta(seconds=self.settings.unsent_grace_s)
        with self.sessions() as session:
            pairs = [
                (r.job_id, r.number)
                for r in session.execute(
                    _waiting(ATTEMPTS.c.job_id, ATTEMPTS.c.number)
                    .where(ATTEMPTS.c.sent_at.is_(None), ATTEMPTS.c.created_at <= cutoff)
                    .order_by(ATTEMPTS.c.job_id)
                    .limit(1000)
                )
            ]
        return dispatch_attempts(self.sessions, self.dispatcher, pairs)

    def _live_attempts(self) -> list[Any]:
        """Every running attempt (as many as there are slots in the cluster), and a window of
        the dispatched ones (there may be a long queue): DISPATCHED_WINDOW per pass, in turn."""
        columns = (
            ATTEMPTS.c.id,
            ATTEMPTS.c.job_id,
            ATTEMPTS.c.number,
            ATTEMPTS.c.status,
            ATTEMPTS.c.hb_missing_since,
            ATTEMPTS.c.node_exits,
            JOBS.c.nodes,
        )
        joined = ATTEMPTS.join(JOBS, JOBS.c.id == ATTEMPTS.c.job_id)
        with self.sessions() as session:
            running = list(
                session.execute(
                    select(*columns).select_from(joined).where(ATTEMPTS.c.status == "running")
                )
            )
            waiting = list(
                session.execute(
                    select(*columns)
                    .select_from(joined)
                    .where(
                        ATTEMPTS.c.status == "dispatched",
                        ATTEMPTS.c.sent_at.is_not(None),
                        ATTEMPTS.c.id > self._dispatched_after,
                    )
                    .order_by(ATTEMPTS.c.id)
                    .limit(DISPATCHED_WINDOW)
                )
            )
        self._dispatched_after = waiting[-1].id if len(waiting) == DISPATCHED_WINDOW else 0
        return running + waiting

    def reap_lost(self) -> int:
        rows = self._live_attempts()
        if not rows:
            return 0
        # Node 0's keys are the single-node keys; a node that reported its exit has dropped
        # its heartbeat on purpose and is not asked about.
        asked = [
            [n for n in range(r.nodes or 1) if str(n) not in (r.node_exits or {})] for r in rows
        ]
        pipe = self.redis.pipeline(transaction=False)
        for r, nodes in zip(rows, asked, strict=True):
            for n in nodes:
                # Its heartbeat, or the marker its worker leaves once the exit event is sent
                # (an exit not yet ingested is not a loss: worker.supervise).
                pipe.exists(
                    self.keys.heartbeat(r.job_id, r.number, n),
                    self.keys.exited(r.job_id, r.number, n),
                )
                pipe.exists(self.keys.claim(r.job_id, r.number, n))
        answers = iter(pipe.execute())
        now = utcnow()
        grace = timedelta(seconds=self.settings.heartbeat_grace_s)
        mark, clear, lost = [], [], []
        why: dict[int, str] = {}
        for r, nodes in zip(rows, asked, strict=True):
            # A node is missing if it runs (or claimed the attempt) without a heartbeat; one
            # still waiting in the Celery queue is not.
            missing = []
            for n in nodes:
                beating, claimed = next(answers), next(answers)
                if not beating and (r.status == "running" or claimed):
                    missing.append(n)
            if (r.nodes or 1) > 1:
                who = ", ".join(str(n) for n in missing)
                why[r.id] = f"heartbeat of node {who} of {r.nodes} expired: its worker stopped"
            if not missing:
                if r.hb_missing_since is not None:
                    clear.append(r.id)  # alive again, or still waiting in the Celery queue
                continue
            if r.hb_missing_since is None:
                mark.append(r.id)
                if grace.total_seconds() == 0:
                    lost.append(r)
            elif now - _aware(r.hb_missing_since) >= grace:
                lost.append(r)
        outcome = Outcome()
        with self.sessions() as session, session.begin():
            if mark:
                session.execute(
                    update(ATTEMPTS).where(ATTEMPTS.c.id.in_(mark)).values(hb_missing_since=now)
                )
            if clear:
                session.execute(
                    update(ATTEMPTS).where(ATTEMPTS.c.id.in_(clear)).values(hb_missing_since=None)
                )
            for r in lost:
                outcome.extend(
                    attempt_lost(
                        session,
                        r.job_id,
                        r.number,
                        message=why.get(r.id, "heartbeat expired: the worker stopped reporting"),
                        at=now,
                    )
                )
        publish_status(
            self.redis, self.keys, outcome.changes, maxlen=self.settings.job_stream_maxlen
        )
        self.stops.send(outcome.to_stop)
        if outcome.to_send:
            dispatch_attempts(self.sessions, self.dispatcher, outcome.to_send)
        if lost:
            self.dispatcher.wake()  # their slots are free again (service.api.scheduling.admit)
        return len(lost)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            orphans = now - self._orphans_at >= self.settings.orphan_check_s
            try:
                self.run_once(orphans=orphans)
                if orphans:
                    self._orphans_at = now
            except Exception as exc:  # an outage: the next pass tries again
                log.warning("reconcile: %s", exc)
            stop.wait(self.settings.reconcile_interval_s)


def _waiting(*columns: Any) -> Any:
    """SELECT ``columns`` of the attempts that wait for a worker: dispatched, and the current
    attempt of a job that is still queued."""
    return (
        select(*columns)
        .join(JOBS, JOBS.c.id == ATTEMPTS.c.job_id)
        .where(
            ATTEMPTS.c.status == "dispatched",
            JOBS.c.status == "queued",
            JOBS.c.attempt == ATTEMPTS.c.number,
        )
    )


def _aware(value: Any) -> Any:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
