"""Retention: deleting finished jobs, one by ``DELETE /v1/jobs/{id}`` or old ones in the
background (``TRAINQ_RETENTION_DAYS``; 0 keeps them forever).

A job is deleted with its attempts, metrics and logs in one transaction per batch of ids.
The foreign keys cascade (``ON DELETE CASCADE`` in the schema, and ``service.api.core.db`` turns
SQLite's foreign keys on), but the children are deleted explicitly all the same, so a
connection made without that pragma cannot leave orphans. Only terminal jobs are deleted:
the status is checked again on the locked rows, whatever the caller checked before. An event
of a deleted job that the ingestor is applying meanwhile fails its foreign key and is then
skipped as a job the store does not have. Then, best effort (the rows are the record): the
job's Redis stream and cancel flag,
and with ``TRAINQ_RETENTION_REMOVE_RUNS`` its run folder, never following a link out of the
runs root.

The background pass runs on one replica at a time (the reconciler's Redis lock with a token,
released only by its holder) and deletes at most ``PASS_MAX`` jobs, the longest ended
first; while more are due the next pass follows after ``BACKLOG_PAUSE_S``, not a full interval.

The same pass prunes the outbox (``TRAINQ_EVENTS_RETENTION_DAYS``, 30 by default; 0 keeps
it forever): webhook deliveries that ended (delivered, or failed for good) that long ago,
and events older than that, but never an event that an unfinished delivery still has to
send (waiting, pending, sending: it is retried for ``webhook_retry_window_s``, whatever the
events' age) nor one an enabled endpoint has not yet fanned out (its cursor is behind it).
In the transaction that deletes a batch of events, each owner's mark (``events_pruned``:
the highest id of theirs pruned, only ever raised) is raised too, so the events feed answers
410 to a cursor that missed a pruned event instead of reading on past the gap.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, exists, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.db import insert_for
from service.api.core.models import (
    ATTEMPTS,
    EVENTS,
    EVENTS_PRUNED,
    JOBS,
    LOGS,
    METRICS,
    TERMINAL,
    WEBHOOK_DELIVERIES,
    WEBHOOKS,
    utcnow,
)
from service.api.core.settings import Settings
from service.api.scheduling.passlock import one_pass
from trainer.events import Keys

__all__ = [
    "BATCH",
    "PASS_MAX",
    "Retention",
    "delete_jobs",
    "mark_pruned",
    "prune_events",
    "remove_run_dir",
    "starting_from",
]

log = logging.getLogger(__name__)

BATCH = 500  # job ids per statement (and per transaction)
PASS_MAX = 5000  # jobs one background pass deletes at most
BACKLOG_PAUSE_S = 1.0  # between passes while more jobs are due
LOCK_TTL_S = 600  # a pass is bounded; a replica that died holding the lock frees it by then

_JOB_ID = re.compile(r"[0-9a-f]{1,32}")
_TERMINAL = sorted(TERMINAL)
_ENDED_DELIVERY = ("delivered", "failed")


@contextmanager
def _begin(db: sessionmaker[Session] | Engine) -> Iterator[Any]:
    """One transaction on a sessionmaker's session or an engine's connection."""
    if isinstance(db, Engine):
        with db.begin() as conn:
            yield conn
    else:
        with db() as session, session.begin():
            yield session


def delete_jobs(
    db: sessionmaker[Session] | Engine,
    job_ids: Iterable[str],
    runs_root: Path,
    remove_runs: bool,
    *,
    redis: Any = None,
    keys: Keys | None = None,
) -> int:
    """Delete the terminal ones of ``job_ids`` with their attempts, metrics and logs; how
    many were deleted (a job that is not terminal, or not there, or that an active job
    starts from as its ``train.init.job``, is left alone). With ``redis``
    and ``keys``, their Redis stream and cancel flag go too; with ``remove_runs``, their run
    folders under ``runs_root``."""
    wanted = sorted({j for j in job_ids if _JOB_ID.fullmatch(j)})
    deleted: list[str] = []
    for start in range(0, len(wanted), BATCH):
        batch = wanted[start : start + BATCH]
        with _begin(db) as tx:
            # Locked first (PostgreSQL; SQLite has one writer anyway): a metric or log being
            # inserted for one of these jobs waits, fails its foreign key, and is skipped
            # when the ingestor applies its batch again event by event.
            ids = list(
                tx.execute(
                    select(JOBS.c.id)
                    .where(JOBS.c.id.in_(batch), JOBS.c.status.in_(_TERMINAL))
                    .with_for_update()
                ).scalars()
            )
            held = {job for job, _, _ in starting_from(tx, ids)}
            ids = [i for i in ids if i not in held]  # still an active job's init weights
            if not ids:
                continue
            for child in (METRICS, LOGS, ATTEMPTS):
                tx.execute(delete(child).where(child.c.job_id.in_(ids)))
            tx.execute(delete(JOBS).where(JOBS.c.id.in_(ids), JOBS.c.status.in_(_TERMINAL)))
        deleted += ids
    if deleted and redis is not None and keys is not None:
        _forget_streams(redis, keys, deleted)
    if remove_runs:
        for job_id in deleted:
            remove_run_dir(runs_root, job_id)
    return len(deleted)


_INIT_JOB = JOBS.c.train[("init", "job")].as_string()
_ACTIVE = ("queued", "running", "cancelling")


def starting_from(conn: Any, job_ids: list[str]) -> list[tuple[str, str, str]]:
    """(job id, the active job that names it in ``train.init.job``, that job's owner) for
    each of ``job_ids`` that a queued, running or cancelling job starts from: such a job is
    not deleted (an attempt loads its init weights when it starts, a retry again)."""
    if not job_ids:
        return []
    stmt = (
        select(_INIT_JOB, JOBS.c.id, JOBS.c.owner)
        .where(JOBS.c.status.in_(_ACTIVE), _INIT_JOB.in_(job_ids))
        .order_by(JOBS.c.id)
    )
    return [(r[0], r[1], r[2]) for r in conn.execute(stmt)]


def _forget_streams(redis: Any, keys: Keys, job_ids: list[str]) -> None:
    try:
        for start in range(0, len(job_ids), BATCH):
            pipe = redis.pipeline(transaction=False)
            for job_id in job_ids[start : start + BATCH]:
                pipe.delete(keys.job(job_id), keys.cancel(job_id))
            pipe.execute()
    except Exception as exc:  # redis.RedisError, OSError: the streams are capped anyway
        log.warning(
            "retention: could not delete the Redis streams of %d job(s): %s", len(job_ids), exc
        )


def remove_run_dir(runs_root: Path, job_id: str) -> bool:
    """Remove ``runs_root/job_id``; True if something was removed. A symlink there is
    unlinked, never followed; anything that does not resolve directly inside the runs root
    is left alone. Errors are logged (the job's rows are already gone)."""
    if not _JOB_ID.fullmatch(job_id):
        return False
    try:
        root = Path(runs_root).resolve()
        path = root / job_id
        if path.is_symlink():
            path.unlink()
            return True
        if not path.exists():
            return False
        if path.resolve().parent != root:
            log.warning("retention: run folder of job %s is not inside the runs root", job_id)
            return False
        if path.is_dir():
            shutil.rmtree(path)  # removes links inside, never what they point to
        else:
            path.unlink()
        return True
    except OSError as exc:
        log.warning("retention: could not remove the run folder of job %s: %s", job_id, exc)
        return False


def prune_events(db: sessionmaker[Session] | Engine, days: float, limit: int = PASS_MAX) -> int:
    """Delete the webhook deliveries that ended over ``days`` ago, and the events older than
    that which no unfinished delivery needs and every enabled endpoint of their owner has
    fanned out; at most ``limit`` of each, in batches of ``BATCH``. The larger of the two
    counts (``limit``: more may be left)."""
    cutoff = utcnow() - timedelta(days=days)
    d = WEBHOOK_DELIVERIES
    needed = exists().where(d.c.event_id == EVENTS.c.id, d.c.status.not_in(_ENDED_DELIVERY))
    unread = exists().where(
        WEBHOOKS.c.owner == EVENTS.c.owner, WEBHOOKS.c.enabled, WEBHOOKS.c.after_event < EVENTS.c.id
    )
    ended = 0
    events = 0
    while ended < limit:
        with _begin(db) as tx:
            old = (
                select(d.c.id)
                .where(d.c.status.in_(_ENDED_DELIVERY), d.c.updated_at < cutoff)
                .order_by(d.c.id)
                .limit(BATCH)
            )
            ids = list(tx.execute(old).scalars())
            if ids:
                tx.execute(delete(d).where(d.c.id.in_(ids)))
        ended += len(ids)
        if len(ids) < BATCH:
            break
    while events < limit:
        with _begin(db) as tx:
            old = (
                select(EVENTS.c.id, EVENTS.c.owner)
                .where(EVENTS.c.created_at < cutoff, ~needed, ~unread)
                .order_by(EVENTS.c.id)
                .limit(BATCH)
                .with_for_update(skip_locked=True)
            )
            rows = tx.execute(old).all()
            ids = [r.id for r in rows]
            if ids:
                # their deliveries all ended (the rest keep the event); the foreign key would
                # cascade, but a SQLite connection without the pragma must not leave orphans
                tx.execute(delete(d).where(d.c.event_id.in_(ids)))
                tx.execute(delete(EVENTS).where(EVENTS.c.id.in_(ids)))
                through: dict[str, int] = {}
                for r in rows:
                    through[r.owner] = max(through.get(r.owner, 0), r.id)
                mark_pruned(tx, through)
        events += len(ids)
        if len(ids) < BATCH:
            break
    if ended or events:
        log.info(
            "retention: pruned %d event(s) and %d ended webhook deliveries over %g day(s) old",
            events,
            ended,
            days,
        )
    return max(events, ended)


def mark_pruned(tx: Any, through: dict[str, int]) -> None:
    """Raise each owner's ``events_pruned`` mark to ``through[owner]`` (never lower it), in
    ``tx``, the transaction that deletes those events."""
    if not through:
        return
    now = utcnow()
    rows = [{"owner": o, "through_id": i, "pruned_at": now} for o, i in sorted(through.items())]
    insert = insert_for(tx)(EVENTS_PRUNED)
    postgres = (tx.get_bind() if isinstance(tx, Session) else tx).dialect.name == "postgresql"
    higher = func.greatest if postgres else func.max  # SQLite's max(a, b) is a scalar max
    new = insert.excluded
    stmt = insert.on_conflict_do_update(
        index_elements=["owner"],
        set_={"through_id": higher(EVENTS_PRUNED.c.through_id, new.through_id),
              "pruned_at": new.pruned_at},
    )  # fmt: skip
    tx.execute(stmt, rows)


class Retention:
    """The background pass: terminal jobs that ended more than ``retention_days`` ago."""

    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session] | Engine, redis: Any
    ) -> None:
        self.settings = settings
        self.backlog = False  # the last pass left events due
        self.sessions = sessions
        self.redis = redis
        self.keys = Keys(settings.redis_prefix)
        self.lock_key = f"{settings.redis_prefix}:retention:lock"

    def due(self, limit: int = PASS_MAX) -> list[str]:
        """Up to ``limit`` ids of the jobs past retention, the longest ended first."""
        cutoff = utcnow() - timedelta(days=self.settings.retention_days)
        # jobs.ended_at has no index: this reads the terminal jobs (ix_jobs_status_id) once
        # per interval, which is cheap next to what the interval lets accumulate.
        with _begin(self.sessions) as tx:
            return list(
                tx.execute(
                    select(JOBS.c.id)
                    .where(JOBS.c.status.in_(_TERMINAL), JOBS.c.ended_at < cutoff)
                    .order_by(JOBS.c.ended_at, JOBS.c.id)
                    .limit(limit)
                ).scalars()
            )

    def run_once(self) -> int:
        """One pass, if retention is on and no other replica holds the lock; jobs deleted
        (and the outbox pruned, ``events_retention_days``)."""
        jobs_days = self.settings.retention_days
        events_days = self.settings.events_retention_days
        if jobs_days <= 0 and events_days <= 0:
            return 0
        deleted = 0
        self.backlog = False
        with one_pass(self.redis, self.lock_key, LOCK_TTL_S) as mine:
            if not mine:
                return 0
            if events_days > 0:  # a full pass: more are due, the next one comes soon
                self.backlog = prune_events(self.sessions, events_days) >= PASS_MAX
            if jobs_days > 0:
                deleted = delete_jobs(
                    self.sessions,
                    self.due(),
                    self.settings.runs_root,
                    self.settings.retention_remove_runs,
                    redis=self.redis,
                    keys=self.keys,
                )
        if deleted:
            days = self.settings.retention_days
            log.info("retention: deleted %d job(s) that ended over %g day(s) ago", deleted, days)
        return deleted

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            done = 0
            try:
                done = self.run_once()
            except Exception as exc:  # an outage: the next pass tries again
                log.warning("retention: %s", exc)
            more = done >= PASS_MAX or self.backlog
            stop.wait(BACKLOG_PAUSE_S if more else self.settings.retention_interval_s)
