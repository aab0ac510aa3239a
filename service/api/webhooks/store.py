"""The deliveries' SQL: fan events out to endpoints, claim what is due, record outcomes.

Every step is a short transaction of a few statements however many deliveries it handles
(one INSERT of a tick's new deliveries, one claim, one UPDATE per outcome batch), so a
deliverer costs the database little per delivery, and several deliverers (one per API
replica, or processes of their own) share the work: claims skip rows another one holds
(``FOR UPDATE SKIP LOCKED``), fan-out inserts are idempotent (``ON CONFLICT DO NOTHING`` on
the endpoint and event).

In order per job: of one job's deliveries to one endpoint only the earliest unfinished one
is ``pending`` (or ``sending``); the later ones are made ``waiting``, and each is made
pending when the one before it ends (delivered, or failed for good). So a job's events reach
an endpoint in the order they happened, across retries, while other jobs' events do not wait
for it; and a claim is a plain walk of the due rows in event order (a partial index), with
no per-row check of what came before. Fan-out and that hand-over take one advisory lock
(PostgreSQL), so a fan-out never makes a delivery wait behind one that ended meanwhile.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, text, update
from sqlalchemy.orm import Session

from service.api.core.db import insert_for
from service.api.core.models import EVENTS, WEBHOOK_DELIVERIES, WEBHOOKS, utcnow
from service.api.core.settings import Settings
from service.api.webhooks.schemas import matches

__all__ = [
    "LIVE",
    "UNFINISHED",
    "Claimed",
    "Endpoint",
    "Outcome",
    "claim",
    "enabled_endpoints",
    "fan_out",
    "lazy_commit",
    "record_outcomes",
    "renew_lease",
    "retry_delay",
]

LIVE = ("pending", "sending")
UNFINISHED = ("waiting", "pending", "sending")
D = WEBHOOK_DELIVERIES
_LOCK_KEY = 0x7472_6171_7768  # "traqwh": fan-out and hand-over, one at a time


def _lock(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})


def lazy_commit(session: Session) -> None:
    """This transaction's commit does not wait for its WAL flush (PostgreSQL's
    ``synchronous_commit`` off, for this transaction only). The deliverer's transactions may:
    one lost in a database crash is still atomic, and costs at most a second try of what it
    recorded (a fan-out is read again, a claim is pending again, an outcome is sent again),
    which delivery at least once allows; while the commits of a busy deliverer no longer
    queue for the disk with the API's own."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))


@dataclass(frozen=True)
class Endpoint:
    id: str
    owner: str
    url: str
    secret: str
    events: tuple[str, ...]
    after_event: int


@dataclass(frozen=True)
class Claimed:
    id: int
    endpoint_id: str
    event_id: int
    job_id: str | None
    attempts: int
    give_up_at: datetime
    type: str
    data: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class Outcome:
    delivery: Claimed
    ok: bool
    status: int | None  # the endpoint's HTTP status, if it answered
    error: str | None


def enabled_endpoints(session: Session) -> list[Endpoint]:
    rows = session.execute(
        select(
            WEBHOOKS.c.id, WEBHOOKS.c.owner, WEBHOOKS.c.url, WEBHOOKS.c.secret,
            WEBHOOKS.c.events, WEBHOOKS.c.after_event,
        ).where(WEBHOOKS.c.enabled)
    )  # fmt: skip
    return [
        Endpoint(r.id, r.owner, r.url, r.secret, tuple(r.events or ()), int(r.after_event))
        for r in rows
    ]


def fan_out(session: Session, endpoints: list[Endpoint], settings: Settings, limit: int) -> int:
    """Deliveries for the events after each endpoint's cursor (of its owner, of the types it
    subscribed to), and the cursors moved past them; the number of events read."""
    if not endpoints:
        return 0
    start = min(e.after_event for e in endpoints)
    owners = sorted({e.owner for e in endpoints})
    rows = session.execute(
        select(EVENTS.c.id, EVENTS.c.owner, EVENTS.c.type, EVENTS.c.job_id, EVENTS.c.created_at)
        .where(EVENTS.c.id > start, EVENTS.c.owner.in_(owners))
        .order_by(EVENTS.c.id)
        .limit(limit)
    ).all()
    if not rows:
        return 0
    now = utcnow()
    window = timedelta(seconds=settings.webhook_retry_window_s)
    new: list[dict[str, Any]] = []
    for ep in endpoints:
        for r in rows:
            if r.id > ep.after_event and r.owner == ep.owner and matches(list(ep.events), r.type):
                new.append(
                    {
                        "endpoint_id": ep.id, "event_id": r.id, "job_id": r.job_id,
                        "status": "pending", "attempts": 0, "next_attempt_at": now,
                        "give_up_at": now + window, "created_at": now, "updated_at": now,
                    }
                )  # fmt: skip
    if new:
        _lock(session)
        # A job's first new delivery waits if the job has an unfinished one already; the
        # rest of its new ones wait behind that first.
        pairs = {(n["endpoint_id"], n["job_id"]) for n in new if n["job_id"] is not None}
        busy = _unfinished(session, pairs)
        for n in new:
            key = (n["endpoint_id"], n["job_id"])
            if n["job_id"] is None:
                continue
            if key in busy:
                n["status"] = "waiting"
            busy.add(key)
        session.execute(
            insert_for(session)(D).on_conflict_do_nothing(
                index_elements=["endpoint_id", "event_id"]
            ),
            new,
        )
    # Every event of these owners up to the last one read was seen: each cursor moves there.
    upto = rows[-1].id
    session.execute(
        update(WEBHOOKS)
        .where(WEBHOOKS.c.id.in_([e.id for e in endpoints]), WEBHOOKS.c.after_event < upto)
        .values(after_event=upto)
    )
    return len(rows)


def _unfinished(session: Session, pairs: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Of these (endpoint, job) pairs, those with an unfinished delivery."""
    found: set[tuple[str, str]] = set()
    ordered = sorted(pairs)
    for i in range(0, len(ordered), 500):
        chunk = ordered[i : i + 500]
        rows = session.execute(
            select(D.c.endpoint_id, D.c.job_id)
            .where(
                D.c.status.in_(UNFINISHED),
                D.c.endpoint_id.in_({e for e, _ in chunk}),
                D.c.job_id.in_({j for _, j in chunk}),
            )
            .distinct()
        )
        found.update((r.endpoint_id, r.job_id) for r in rows if (r.endpoint_id, r.job_id) in pairs)
    return found


def claim(session: Session, *, limit: int, rooms: dict[str, int], lease_s: float) -> list[Claimed]:
    """Up to ``limit`` deliveries that are due, oldest event first, at most
    ``rooms[endpoint]`` of each endpoint named there (the enabled ones with room), none
    behind an earlier live delivery of its job: held (``sending``) for ``lease_s`` (after
    that another deliverer may take them: this one is taken to be dead)."""
    wanted = sorted(e for e, room in rooms.items() if room > 0)
    if not wanted or limit <= 0:
        return []
    now = utcnow()
    query = (
        select(
            D.c.id,
            D.c.endpoint_id,
            D.c.event_id,
            D.c.job_id,
            D.c.attempts,
            D.c.give_up_at,
            EVENTS.c.type,
            EVENTS.c.data,
            EVENTS.c.created_at,
        )
        .join(EVENTS, EVENTS.c.id == D.c.event_id)
        .join(WEBHOOKS, WEBHOOKS.c.id == D.c.endpoint_id)
        .where(
            D.c.status.in_(LIVE),
            D.c.next_attempt_at <= now,
            D.c.endpoint_id.in_(wanted),
            WEBHOOKS.c.enabled,  # as of now: the caller's list may be a poll interval old
        )
        .order_by(D.c.event_id)
        .limit(limit)
        .with_for_update(of=D, skip_locked=True)
    )
    left = dict(rooms)
    kept = []
    for r in session.execute(query):
        if left[r.endpoint_id] > 0:
            kept.append(r)
            left[r.endpoint_id] -= 1
    rows = kept  # the rest stay pending (their row locks end with this transaction)
    if not rows:
        return []
    session.execute(
        update(D)
        .where(D.c.id.in_([r.id for r in rows]))
        .values(status="sending", next_attempt_at=now + timedelta(seconds=lease_s), updated_at=now)
    )
    return [
        Claimed(
            r.id,
            r.endpoint_id,
            r.event_id,
            r.job_id,
            r.attempts,
            r.give_up_at,
            r.type,
            r.data,
            r.created_at,
        )
        for r in rows
    ]


def renew_lease(session: Session, ids: list[int], lease_s: float) -> None:
    """Hold these claimed deliveries (still ``sending``) for another ``lease_s``."""
    if not ids:
        return
    now = utcnow()
    session.execute(
        update(D)
        .where(D.c.id.in_(ids), D.c.status == "sending")
        .values(next_attempt_at=now + timedelta(seconds=lease_s))
    )


def retry_delay(settings: Settings, failures: int) -> float:
    """Seconds before the next try after the ``failures``-th failure in a row: exponential,
    capped, with "equal jitter" (between half and all of it), so endpoints that failed
    together are not all retried at the same instant."""
    full = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** (failures - 1))
    return full / 2 + random.uniform(0, full / 2)


# An outcome is stored only on the claim it is for (still sending, its attempts not counted
# since): a deliverer whose lease lapsed, and whose deliveries another took over and ended,
# changes nothing.
_FINISH = (
    update(D)
    .where(
        D.c.id == bindparam("did"),
        D.c.status == "sending",
        D.c.attempts == bindparam("attempts") - 1,
    )
    .values(
        status=bindparam("status"),
        attempts=bindparam("attempts"),
        next_attempt_at=bindparam("next_at"),
        last_status=bindparam("last_status"),
        last_error=bindparam("last_error"),
        updated_at=bindparam("now"),
    )
)


_WAITING = D.alias("waiting")
# The job's next waiting delivery to the endpoint becomes pending (the one before it ended).
_NEXT = (
    update(D)
    .where(
        D.c.id
        == select(_WAITING.c.id)
        .where(
            _WAITING.c.endpoint_id == bindparam("e"),
            _WAITING.c.job_id == bindparam("j"),
            # literal, as the partial index's predicate (an IN list cannot go to executemany)
            text("waiting.status IN ('pending', 'sending', 'waiting')"),
        )
        .order_by(_WAITING.c.event_id)
        .limit(1)
        .scalar_subquery(),
        D.c.status == "waiting",
    )
    .values(status="pending", next_attempt_at=bindparam("now"), updated_at=bindparam("now"))
)


_FINISH_PG = text(
    "UPDATE webhook_deliveries AS d SET status = v.status, attempts = v.attempts,"
    " next_attempt_at = v.next_at, last_status = v.last_status, last_error = v.last_error,"
    " updated_at = :now"
    " FROM unnest(CAST(:ids AS bigint[]), CAST(:statuses AS varchar[]),"
    " CAST(:attempts AS integer[]), CAST(:next_ats AS timestamptz[]),"
    " CAST(:last_statuses AS integer[]), CAST(:last_errors AS text[]))"
    " AS v(id, status, attempts, next_at, last_status, last_error)"
    " WHERE d.id = v.id AND d.status = 'sending' AND d.attempts = v.attempts - 1"
)
_NEXT_PG = text(
    "UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = :now, updated_at = :now"
    " WHERE status = 'waiting' AND id IN ("
    " SELECT DISTINCT ON (w.endpoint_id, w.job_id) w.id FROM webhook_deliveries AS w"
    " JOIN unnest(CAST(:es AS varchar[]), CAST(:js AS varchar[])) AS p(e, j)"
    " ON w.endpoint_id = p.e AND w.job_id = p.j"
    " WHERE w.status IN ('pending', 'sending', 'waiting')"
    " ORDER BY w.endpoint_id, w.job_id, w.event_id)"
)


def record_outcomes(session: Session, settings: Settings, outcomes: list[Outcome]) -> list[str]:
    """Store each try's outcome: delivered, pending again after a backoff, or failed once
    past its window; count failures per endpoint, and disable those past the limits. The
    ids of the endpoints disabled."""
    if not outcomes:
        return []
    now = utcnow()
    params = []
    ok: set[str] = set()
    failed: dict[str, tuple[int, str]] = {}
    for o in outcomes:
        d = o.delivery
        attempts = d.attempts + 1
        if o.ok:
            status, next_at = "delivered", now
            ok.add(d.endpoint_id)
            failed.pop(d.endpoint_id, None)
        else:
            next_at = now + timedelta(seconds=retry_delay(settings, attempts))
            give_up = _aware(d.give_up_at)
            status = "failed" if next_at > give_up else "pending"
            count, _ = failed.get(d.endpoint_id, (0, ""))
            failed[d.endpoint_id] = (count + 1, o.error or f"HTTP {o.status}")
        params.append(
            {
                "did": d.id, "status": status, "attempts": attempts, "next_at": next_at,
                "last_status": o.status, "last_error": None if o.ok else (o.error or "")[:1000],
                "now": now, "endpoint": d.endpoint_id, "job": d.job_id,
            }
        )  # fmt: skip
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:  # one statement for the batch, not one per row
        session.execute(
            _FINISH_PG,
            {
                "ids": [p["did"] for p in params],
                "statuses": [p["status"] for p in params],
                "attempts": [p["attempts"] for p in params],
                "next_ats": [p["next_at"] for p in params],
                "last_statuses": [p["last_status"] for p in params],
                "last_errors": [p["last_error"] for p in params],
                "now": now,
            },
        )
    else:
        session.execute(_FINISH, params)
    ended = sorted(
        {
            (p["endpoint"], p["job"])
            for p in params
            if p["status"] in ("delivered", "failed") and p["job"] is not None
        }
    )
    if ended:
        _lock(session)
        if postgres:
            session.execute(
                _NEXT_PG,
                {"es": [e for e, _ in ended], "js": [j for _, j in ended], "now": now},
            )
        else:
            session.execute(_NEXT, [{"e": e, "j": j, "now": now} for e, j in ended])
    if ok - set(failed):
        session.execute(
            update(WEBHOOKS)
            .where(WEBHOOKS.c.id.in_(sorted(ok - set(failed))), WEBHOOKS.c.failures > 0)
            .values(failures=0, failing_since=None)
        )
    disabled = []
    for endpoint_id, (count, error) in failed.items():
        session.execute(
            update(WEBHOOKS)
            .where(WEBHOOKS.c.id == endpoint_id)
            .values(
                failures=WEBHOOKS.c.failures + count,
                failing_since=func.coalesce(WEBHOOKS.c.failing_since, now),
            )
        )
        since = now - timedelta(seconds=settings.webhook_disable_after_s)
        row = session.execute(
            select(WEBHOOKS.c.failures, WEBHOOKS.c.failing_since).where(
                WEBHOOKS.c.id == endpoint_id,
                WEBHOOKS.c.enabled,
                WEBHOOKS.c.failures >= settings.webhook_disable_failures,
                WEBHOOKS.c.failing_since <= since,
            )
        ).first()
        if row is None:
            continue
        reason = (
            f"disabled after {row.failures} failed deliveries in a row since"
            f" {_aware(row.failing_since).isoformat(timespec='seconds')}; last: {error[:300]}"
        )
        session.execute(
            update(WEBHOOKS)
            .where(WEBHOOKS.c.id == endpoint_id)
            .values(enabled=False, disabled_reason=reason, updated_at=now)
        )
        disabled.append(endpoint_id)
    return disabled


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
