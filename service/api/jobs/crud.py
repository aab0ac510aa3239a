"""Job queries and writes behind the routes: create (idempotent), get, list (keyset), queue
position. Core statements on the tables, to keep the hot paths lean. What runs reported
(metrics, logs) is read in ``reports``; the SQL-built JSON of one job in ``job_json``.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    false,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.api.core.auth import Principal
from service.api.core.db import AsyncReader
from service.api.core.errors import Conflict, InvalidInput
from service.api.core.models import ATTEMPTS, JOBS, new_job_id, utcnow
from service.api.jobs import room as room_mod
from service.api.jobs.schemas import JobSpec

__all__ = [
    "acreate_jobs",
    "aqueue_position",
    "attempts_of",
    "create_job",
    "decode_cursor",
    "encode_cursor",
    "get_job",
    "insert_job",
    "job_row",
    "list_jobs",
    "queue_position",
]


# Reads run on a Session or, on the hot paths, straight on an autocommit Connection.
Reader = Session | Connection

SUMMARY_COLUMNS = [c for c in JOBS.c if c.name not in ("train", "spec_hash", "idempotency_key")]


_INSERT_JOB = insert(JOBS)
_INSERT_ATTEMPT = insert(ATTEMPTS)


_NEW_JOB = (
    insert(JOBS)
    .values({c.name: bindparam(c.name, type_=c.type) for c in JOBS.c})
    .returning(JOBS.c.id, JOBS.c.created_at)
    .cte("new_job")
)
_INSERT_JOB_AND_ATTEMPT = insert(ATTEMPTS).from_select(
    ["job_id", "number", "status", "free", "created_at"],
    select(_NEW_JOB.c.id, literal(1), literal("dispatched"), false(), _NEW_JOB.c.created_at),
)


def job_row(
    principal: Principal, spec: JobSpec, idempotency_key: str | None, disk_bytes: int = 0
) -> dict[str, Any]:
    """A new queued job's row (every column), as create_job and acreate_jobs insert it;
    ``disk_bytes``: its run folder's worst case (service.api.jobs.room)."""
    return {
        "id": new_job_id(),
        "owner": principal.name,
        "name": spec.name,
        "queue": spec.queue,
        "labels": dict(spec.labels),
        "nodes": spec.nodes,
        "procs_per_node": spec.procs_per_node,
        "max_runtime_s": spec.max_runtime_s,
        "retries": spec.retries,
        "priority": spec.priority,
        "train": spec.train.model_dump(mode="json"),
        "spec_hash": spec.spec_hash(),
        "idempotency_key": idempotency_key,
        "status": "queued",
        "reason": None,
        "message": None,
        "attempt": 1,
        "retries_used": 0,
        "not_before": None,
        "preempted_at": None,
        "created_at": utcnow(),
        "started_at": None,
        "ended_at": None,
        "metric_attempt": None,
        "last_step": None,
        "last_metrics": None,
        "disk_bytes": disk_bytes,
        "sweep": None,
        "params": None,
    }


def create_job(
    session: Session | Connection,
    principal: Principal,
    spec: JobSpec,
    idempotency_key: str | None,
    *,
    disk_bytes: int = 0,
    room: int = 0,
) -> tuple[dict[str, Any], bool]:
    """Insert a queued job and its first attempt; (row, created). The same idempotency key
    with the same spec returns the existing job, with another spec raises Conflict. On
    PostgreSQL ``session`` may be an autocommit Connection (a data-modifying CTE then inserts
    both rows in one statement); elsewhere a Session, and a transaction of two INSERTs.
    With ``room`` (bytes; a Session), the job's ``disk_bytes`` must fit beside its owner's
    other runs, checked under the owner's lock (service.api.jobs.room), else InvalidInput."""
    row = job_row(principal, spec, idempotency_key, disk_bytes)
    try:
        if isinstance(session, Connection):
            # An autocommit PostgreSQL connection: the job and its attempt in one atomic
            # statement, one round trip (instead of BEGIN, two INSERTs, COMMIT).
            session.execute(_INSERT_JOB_AND_ATTEMPT, row)
        elif room:
            with session.begin():
                room_mod.lock(session, principal.name)  # first: this owner's submits in turn
                if idempotency_key is not None:
                    found = _existing(session, principal, idempotency_key, row["spec_hash"])
                    if found is not None:  # a replay creates nothing: never refused
                        return found, False
                room_mod.check(session, principal.name, disk_bytes, room)
                insert_job(session, row)
        else:
            with session.begin():
                insert_job(session, row)
        return row, True
    except IntegrityError:
        if idempotency_key is None:
            raise
    # The unique (owner, idempotency_key) said another request got there first; on
    # PostgreSQL the conflict waits for that transaction, so its row is committed by now.
    existing = _existing(session, principal, idempotency_key, row["spec_hash"])
    session.rollback()
    if existing is None:  # the other request rolled back: take its place
        return create_job(
            session, principal, spec, idempotency_key, disk_bytes=disk_bytes, room=room
        )
    return existing, False


def insert_job(session: Session, row: dict[str, Any]) -> None:
    # Parameters apart from the statement: the compiled INSERT is cached.
    session.execute(_INSERT_JOB, row)
    session.execute(
        _INSERT_ATTEMPT,
        {
            "job_id": row["id"],
            "number": 1,
            "status": "dispatched",
            "free": False,
            "created_at": row["created_at"],
        },
    )


def _existing(
    session: Session | Connection, principal: Principal, key: str, spec_hash: str
) -> dict[str, Any] | None:
    """The job the owner's Idempotency-Key made, or None; Conflict if made of another spec."""
    existing = (
        session.execute(
            select(JOBS).where(JOBS.c.owner == principal.name, JOBS.c.idempotency_key == key)
        )
        .mappings()
        .first()
    )
    if existing is None:
        return None
    if existing["spec_hash"] != spec_hash:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used for job {existing['id']}"
            " with a different spec"
        )
    return dict(existing)


# Many new jobs and their first attempts in one statement (so one commit): group commit of
# concurrent submits (service.api.jobs.submit). The rows go as one JSON array (one json.dumps in C,
# instead of adapting each value of each row); the text stays the same for any number of
# rows, so it stays prepared. The JSON columns keep the text json.dumps gave them, as when
# SQLAlchemy inserts one. A job whose Idempotency-Key its owner already used is skipped (ON
# CONFLICT DO NOTHING, which waits for a concurrent insert of that key to end) and left out
# of the ids returned: create_job, one by one, answers it.
_NEW_JOB_COLUMNS = [
    "id", "owner", "name", "queue", "labels", "nodes", "procs_per_node", "max_runtime_s",
    "retries", "priority", "train", "spec_hash", "idempotency_key", "status", "attempt",
    "retries_used", "created_at", "disk_bytes",
]  # fmt: skip
_SQL_CREATE_JOBS = (
    f"WITH new_jobs AS (INSERT INTO jobs ({', '.join(_NEW_JOB_COLUMNS)})"
    f" SELECT {', '.join(_NEW_JOB_COLUMNS)}"
    " FROM json_populate_recordset(NULL::jobs, %(rows)s::json)"
    " ON CONFLICT (owner, idempotency_key) DO NOTHING RETURNING id, created_at)"
    " INSERT INTO attempts (job_id, number, status, free, created_at)"
    " SELECT id, 1, 'dispatched', false, created_at FROM new_jobs RETURNING job_id"
)


async def acreate_jobs(reader: AsyncReader, rows: list[dict[str, Any]]) -> set[str]:
    """Insert ``job_row``s and their first attempts, committed together; the ids inserted."""
    payload = json.dumps(
        [{c: r[c] for c in _NEW_JOB_COLUMNS} for r in rows], default=datetime.isoformat
    )
    found = await reader.fetch(_SQL_CREATE_JOBS, {"rows": payload}, tuples=True)
    return {row[0] for row in found}


def get_job(session: Reader, principal: Principal, job_id: str) -> RowMapping | None:
    stmt = select(JOBS).where(JOBS.c.id == job_id)
    if not principal.admin:
        stmt = stmt.where(JOBS.c.owner == principal.name)
    return session.execute(stmt).mappings().first()


# The attempt columns a job's answer shows, prefixed so they sit beside the job's in one row.
_ATTEMPT_OUT = [
    ATTEMPTS.c[name].label(f"a_{name}")
    for name in (
        "number",
        "status",
        "host",
        "worker",
        "exit_code",
        "reason",
        "message",
        "created_at",
        "started_at",
        "ended_at",
    )
]


_JOB_OUT = [c for c in JOBS.c if c.name not in ("spec_hash", "idempotency_key")]
# Built once: constructing a statement costs more than running it on the hot path.
_JOB_WITH_ATTEMPTS = (
    select(*_JOB_OUT, *_ATTEMPT_OUT)
    .outerjoin(ATTEMPTS, ATTEMPTS.c.job_id == JOBS.c.id)
    .where(JOBS.c.id == bindparam("job_id"))
    .order_by(ATTEMPTS.c.number)
)
_OWN_JOB_WITH_ATTEMPTS = _JOB_WITH_ATTEMPTS.where(JOBS.c.owner == bindparam("owner"))


def get_job_with_attempts(
    session: Reader, principal: Principal, job_id: str
) -> tuple[RowMapping | None, list[dict[str, Any]]]:
    """The job and its attempts in one round trip (a join: one row per attempt)."""
    if principal.admin:
        result = session.execute(_JOB_WITH_ATTEMPTS, {"job_id": job_id})
    else:
        result = session.execute(
            _OWN_JOB_WITH_ATTEMPTS, {"job_id": job_id, "owner": principal.name}
        )
    return _split_attempts(list(result.mappings()))


def _split_attempts(rows: list[Any]) -> tuple[Any, list[dict[str, Any]]]:
    if not rows:
        return None, []
    attempts = [
        {key[2:]: value for key, value in r.items() if key.startswith("a_")}
        for r in rows
        if r["a_number"] is not None
    ]
    return rows[0], attempts


# The queue position as text for the event-loop reader on PostgreSQL (compiled once, here).
# A queued job's position (1 + the queued jobs of its queue submitted before it), keyed by
# job id for AsyncReader.fetch_keyed. The (queue, status, id) index serves the count.
_SQL_QUEUE_POSITION = (
    "SELECT j.id, 1 + (SELECT count(*) FROM jobs q WHERE q.queue = j.queue"
    " AND q.status = 'queued' AND q.id < j.id) FROM jobs j WHERE j.id = ANY(%(keys)s)"
)


async def aqueue_position(reader: AsyncReader, job_id: str) -> int:
    """``queue_position`` on the event loop; concurrent requests' counts share a statement."""
    row = await reader.fetch_keyed(_SQL_QUEUE_POSITION, job_id)
    return int(row[1]) if row is not None else 1


def job_exists(session: Reader, principal: Principal, job_id: str) -> bool:
    stmt = select(JOBS.c.id).where(JOBS.c.id == job_id)
    if not principal.admin:
        stmt = stmt.where(JOBS.c.owner == principal.name)
    return session.execute(stmt).first() is not None


def attempts_of(session: Reader, job_id: str) -> list[RowMapping]:
    return list(
        session.execute(
            select(ATTEMPTS).where(ATTEMPTS.c.job_id == job_id).order_by(ATTEMPTS.c.number)
        ).mappings()
    )


def queue_position(session: Reader, queue: str, job_id: str) -> int:
    """1 + the queued jobs of this queue submitted before this one (oldest runs first)."""
    ahead = session.execute(
        select(func.count())
        .select_from(JOBS)
        .where(JOBS.c.queue == queue, JOBS.c.status == "queued", JOBS.c.id < job_id)
    ).scalar_one()
    return int(ahead) + 1


def encode_cursor(job_id: str) -> str:
    return base64.urlsafe_b64encode(job_id.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput.at(["query", "cursor"], "cursor is not one this API issued") from exc
    if not raw or len(raw) > 32 or not raw.isalnum():
        raise InvalidInput.at(["query", "cursor"], "cursor is not one this API issued")
    return raw


def list_jobs(
    session: Reader,
    principal: Principal,
    *,
    status: str | None,
    name: str | None,
    labels: list[tuple[str, str]],
    limit: int,
    after_id: str | None,
) -> tuple[list[RowMapping], str | None]:
    """Newest first; keyset on the time-ordered id, so a deep page costs what the first does."""
    stmt = select(*SUMMARY_COLUMNS)
    if not principal.admin:
        stmt = stmt.where(JOBS.c.owner == principal.name)
    if status is not None:
        stmt = stmt.where(JOBS.c.status == status)
    if name is not None:
        stmt = stmt.where(JOBS.c.name == name)
    for key, value in labels:
        stmt = stmt.where(JOBS.c.labels[key].as_string() == value)
    if after_id is not None:
        stmt = stmt.where(JOBS.c.id < after_id)
    rows = list(session.execute(stmt.order_by(JOBS.c.id.desc()).limit(limit + 1)).mappings())
    next_cursor = encode_cursor(rows[limit - 1]["id"]) if len(rows) > limit else None
    return rows[:limit], next_cursor
