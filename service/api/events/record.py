"""Recording an event: one row of the outbox, in the caller's transaction.

Whatever changes a job (the state machine, the ingestor) records its event in the same
transaction as the change, so an event exists if and only if the change committed; the
events feed (``GET /v1/events``) and webhook deliveries read only this table.

Ids are the feed's cursor, so they must become visible in order: a reader that has seen id
11 must never later find a 10 that committed after it. On PostgreSQL a transaction that
records takes a transaction-level advisory lock first (held to its commit), so transactions
that record events commit one at a time, in id order. SQLite has one writer anyway.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, literal, select, text
from sqlalchemy.orm import Session

from service.api.core.db import insert_for
from service.api.core.models import EVENTS, JOBS, utcnow

__all__ = ["EVENT_TYPES", "record_event", "record_job_event"]

# What an endpoint may subscribe to (patterns such as ``job.*`` are matched against these).
EVENT_TYPES = (
    "job.queued",
    "job.running",
    "job.cancelling",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "job.stopped_early",
    "checkpoint.written",
    "sweep.created",
    "sweep.finished",
    "sweep.cancelled",
)

_LOCK_KEY = 0x7472_6171_6576  # "traqev": one key for every transaction that records
_LOCKED = "trainq.events.locked"


def _lock(session: Session) -> None:
    if session.get_bind().dialect.name != "postgresql":
        return
    transaction = session.get_transaction()
    if session.info.get(_LOCKED) is transaction:
        return  # taken earlier in this transaction (it is held to the commit)
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    session.info[_LOCKED] = transaction


def _insert(session: Session, key: str | None) -> Any:
    if key is None:
        return insert(EVENTS)
    return insert_for(session)(EVENTS).on_conflict_do_nothing(index_elements=["dedupe_key"])


def record_event(
    session: Session,
    *,
    owner: str,
    type: str,
    data: dict[str, Any],
    job_id: str | None = None,
    key: str | None = None,
) -> None:
    """Record an event of ``owner`` in ``session``'s transaction (the caller commits it):
    ``type`` such as ``sweep.finished``, ``data`` a JSON object (the delivery's ``data``).
    ``key``: an event with this key is recorded once (a replay records nothing)."""
    _lock(session)
    session.execute(
        _insert(session, key).values(
            owner=owner,
            type=type,
            job_id=job_id,
            data=data,
            dedupe_key=key,
            created_at=utcnow(),
        )
    )


def record_job_event(
    session: Session, *, type: str, job_id: str, data: dict[str, Any], key: str | None = None
) -> None:
    """``record_event`` for the job's owner, read in the same statement (nothing if the job
    is not in the store)."""
    _lock(session)
    row = select(
        JOBS.c.owner,
        literal(type),
        JOBS.c.id,
        literal(data, EVENTS.c.data.type),
        literal(key, EVENTS.c.dedupe_key.type),
        literal(utcnow(), EVENTS.c.created_at.type),
    ).where(JOBS.c.id == job_id)
    session.execute(
        _insert(session, key).from_select(
            ["owner", "type", "job_id", "data", "dedupe_key", "created_at"], row
        )
    )
