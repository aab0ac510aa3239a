"""The job state machine: every status change of a job or an attempt goes through here.

Transitions are compare-and-set (``UPDATE ... WHERE status IN (:expected)``) and a job's
transitions also match the attempt they are about, so a replayed or late event (an attempt
that already ended, an attempt the job has moved past) changes nothing. Functions run inside
the caller's transaction and return what changed; the caller commits, then publishes.

::

    job:      queued ─▶ running ─▶ succeeded | failed | cancelled
                 ▲         │ └──▶ cancelling ─▶ cancelled | stopped_early
                 │         │                   (or whatever the exit says)
                 └─────────┘ retry: a new attempt, resuming from the run's checkpoint
    attempt:  dispatched ─▶ running ─▶ exited | lost

A multi-node attempt (one worker task per node) is ``running`` at its first node's running
event. It ends when the last node has exited successfully, or at the first node that fails
(or is lost); that ending also asks the nodes still running to stop (``Outcome.to_stop``),
and their exits, coming after, change nothing. The nodes done so far are kept in
``attempts.node_exits``, read under a row lock, so two replicas ingesting two nodes' exits
at once cannot both miss the last one, and a replayed exit is recognised.

An attempt called lost, of one node or several, is asked to stop too: its host may only be
cut off, its run alive, and once back it would hold its worker's slot for as long as the run
lasts, a slot the job's next attempt may be waiting for (worker.supervise reads the key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from service.api.core.models import ATTEMPTS, JOBS, utcnow
from service.api.events.record import record_job_event

__all__ = [
    "RETRYABLE",
    "Outcome",
    "StatusChange",
    "attempt_exited",
    "attempt_lost",
    "attempt_running",
    "cancel_job",
    "stop_early",
]

# Failures that a new attempt may fix; spec_error, nan_loss and timeout would only repeat.
RETRYABLE = frozenset({"lost", "superseded", "exit_code", "oom"})


@dataclass(frozen=True)
class StatusChange:
    job_id: str
    attempt: int
    status: str
    reason: str | None = None
    message: str | None = None


@dataclass
class Outcome:
    changes: list[StatusChange] = field(default_factory=list)
    to_send: list[tuple[str, int]] = field(default_factory=list)  # new attempts to dispatch
    # Attempts that ended while some of their nodes may still run: a multi-node attempt that
    # failed, or any attempt called lost (its host may be cut off, not dead).
    to_stop: list[tuple[str, int]] = field(default_factory=list)

    def extend(self, other: Outcome) -> None:
        self.changes.extend(other.changes)
        self.to_send.extend(other.to_send)
        self.to_stop.extend(other.to_stop)


def _changed(session: Session, out: Outcome, change: StatusChange) -> None:
    """A job's status changed: into the outcome (published after the commit) and into the
    events outbox, in this transaction (``job.<status>``, for the feed and webhooks)."""
    out.changes.append(change)
    data = {
        "job_id": change.job_id,
        "attempt": change.attempt,
        "status": change.status,
        "reason": change.reason,
        "message": change.message,
    }
    record_job_event(session, type=f"job.{change.status}", job_id=change.job_id, data=data)


def _cas_job(
    session: Session, job_id: str, current: int, expected: tuple[str, ...], **values: Any
) -> bool:
    result = session.execute(
        update(JOBS)
        .where(JOBS.c.id == job_id, JOBS.c.attempt == current, JOBS.c.status.in_(expected))
        .values(**values)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def _cas_attempt(
    session: Session, job_id: str, number: int, expected: tuple[str, ...], **values: Any
) -> bool:
    result = session.execute(
        update(ATTEMPTS)
        .where(
            ATTEMPTS.c.job_id == job_id,
            ATTEMPTS.c.number == number,
            ATTEMPTS.c.status.in_(expected),
        )
        .values(**values)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def attempt_running(
    session: Session,
    job_id: str,
    number: int,
    *,
    host: str | None,
    worker: str | None,
    pid: int | None,
    at: datetime | None = None,
) -> Outcome:
    """The worker launched torchrun for this attempt."""
    at = at or utcnow()
    out = Outcome()
    if not _cas_attempt(
        session,
        job_id,
        number,
        ("dispatched",),
        status="running",
        host=host,
        worker=worker,
        pid=pid,
        started_at=at,
        hb_missing_since=None,
    ):
        return out
    if _cas_job(
        session,
        job_id,
        number,
        ("queued",),
        status="running",
        reason=None,
        message=None,
        started_at=func.coalesce(JOBS.c.started_at, at),
    ):
        _changed(session, out, StatusChange(job_id, number, "running"))
    return out


def attempt_exited(
    session: Session,
    job_id: str,
    number: int,
    *,
    exit_code: int | None,
    reason: str | None,
    message: str,
    node: int | None = None,
    at: datetime | None = None,
    gang_backoff: tuple[float, float] | None = None,
) -> Outcome:
    """The attempt (or one ``node`` of it) ended; reason None with exit code 0 is a success.
    ``gang_backoff`` (base, cap in seconds): a gang that failed to start (``no_worker``) is
    requeued without spending a retry, held back base * 2^(n-1) s after its n-th such
    failure (the admitter's safety net); None: it fails, as without admission."""
    at = at or utcnow()
    if reason is None and exit_code != 0:
        reason = "exit_code"
    nodes = _nodes(session, job_id) if node is not None else 1
    if nodes > 1 and node is not None:
        return _node_exited(
            session, job_id, number, node, nodes, exit_code=exit_code, reason=reason,
            message=message, at=at, gang_backoff=gang_backoff,
        )  # fmt: skip
    return (
        _exit(session, job_id, number, exit_code, reason, message, at, gang_backoff=gang_backoff)
        or Outcome()
    )


def _exit(
    session: Session,
    job_id: str,
    number: int,
    exit_code: int | None,
    reason: str | None,
    message: str,
    at: datetime,
    gang_backoff: tuple[float, float] | None = None,
    **values: Any,
) -> Outcome | None:
    """End a live attempt as exited and settle its job; None if it had already ended."""
    if not _cas_attempt(
        session,
        job_id,
        number,
        ("dispatched", "running"),
        status="exited",
        exit_code=exit_code,
        reason=reason,
        message=message,
        ended_at=at,
        **values,
    ):
        return None
    return _settle(session, job_id, number, reason, message, at, gang_backoff)


def _nodes(session: Session, job_id: str) -> int:
    return int(session.execute(select(JOBS.c.nodes).where(JOBS.c.id == job_id)).scalar() or 1)


def _node_exited(
    session: Session,
    job_id: str,
    number: int,
    node: int,
    nodes: int,
    *,
    exit_code: int | None,
    reason: str | None,
    message: str,
    at: datetime,
    gang_backoff: tuple[float, float] | None = None,
) -> Outcome:
    """One node of a multi-node attempt exited: record it, and end the attempt at the first
    failure or once every node has succeeded."""
    row = session.execute(
        select(ATTEMPTS.c.status, ATTEMPTS.c.node_exits)
        .where(ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.number == number)
        .with_for_update()
    ).first()
    if row is None or row.status not in ("dispatched", "running") or not 0 <= node < nodes:
        return Outcome()  # the attempt already ended: a late node changes nothing
    done = dict(row.node_exits or {})
    if str(node) in done:
        return Outcome()  # a replayed exit
    done[str(node)] = {"exit_code": exit_code, "reason": reason}
    where = (ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.number == number)
    if reason is None and len(done) < nodes:
        session.execute(update(ATTEMPTS).where(*where).values(node_exits=done))
        return Outcome()
    if reason is not None:
        message = f"node {node} of {nodes}: {message}"
    out = _exit(
        session, job_id, number, exit_code, reason, message, at, gang_backoff, node_exits=done
    )
    if out is None:
        return Outcome()
    if reason is not None:
        out.to_stop.append((job_id, number))
    return out


def attempt_lost(
    session: Session, job_id: str, number: int, *, message: str, at: datetime | None = None
) -> Outcome:
    """The attempt's heartbeat expired: its worker is gone (crashed, partitioned, killed)."""
    at = at or utcnow()
    if not _cas_attempt(
        session,
        job_id,
        number,
        ("dispatched", "running"),
        status="lost",
        reason="lost",
        message=message,
        ended_at=at,
    ):
        return Outcome()
    out = _settle(session, job_id, number, "lost", message, at)
    # Its nodes may still run, or wait: a host cut off, not dead, or the other nodes.
    out.to_stop.append((job_id, number))
    return out


def _settle(
    session: Session,
    job_id: str,
    number: int,
    reason: str | None,
    message: str,
    at: datetime,
    gang_backoff: tuple[float, float] | None = None,
) -> Outcome:
    """Decide the job once its current attempt has ended: done, failed, or a new attempt."""
    out = Outcome()
    row = session.execute(
        select(JOBS.c.status, JOBS.c.reason, JOBS.c.retries, JOBS.c.retries_used).where(
            JOBS.c.id == job_id, JOBS.c.attempt == number
        )
    ).first()
    if row is None or row.status not in ("queued", "running", "cancelling"):
        return out  # an attempt the job has moved past, or a job already settled
    live = ("queued", "running", "cancelling")

    def finish(status: str, why: str | None, text: str | None) -> Outcome:
        if _cas_job(
            session, job_id, number, live, status=status, reason=why, message=text, ended_at=at
        ):
            _changed(session, out, StatusChange(job_id, number, status, why, text))
        return out

    if row.status == "cancelling" and row.reason == STOPPED_EARLY:
        return finish(STOPPED_EARLY, STOPPED_EARLY, EARLY_TEXT)  # whatever the exit said
    if row.status == "cancelling" or reason == "cancelled":
        return finish("cancelled", "cancelled", message or "cancelled")
    if reason is None:
        return finish("succeeded", None, None)
    gang = reason == "no_worker" and gang_backoff is not None
    free = reason == "preempted" or gang
    if not free and not (reason in RETRYABLE and row.retries_used < row.retries):
        return finish("failed", reason, message)

    used = row.retries_used + (0 if free else 1)
    note = (
        "preempted; requeued in its place (no retry spent)"
        if free
        else f"retry {used} of {row.retries}"
    )
    extra: dict[str, Any] = {}
    if gang:
        assert gang_backoff is not None
        failures = _gang_failures(session, job_id)
        wait = min(gang_backoff[1], gang_backoff[0] * 2 ** max(0, failures - 1))
        extra["not_before"] = at + timedelta(seconds=wait)
        note = (
            f"its gang did not start ({failures} time(s)); requeued (no retry spent),"
            f" admitted again after {wait:g} s"
        )
    text = f"attempt {number} ended ({reason}: {message}); {note}"
    if not _cas_job(
        session,
        job_id,
        number,
        live,
        status="queued",
        attempt=number + 1,
        retries_used=used,
        reason=reason,
        message=text,
        **extra,
    ):
        return out
    session.execute(
        insert(ATTEMPTS).values(
            job_id=job_id, number=number + 1, status="dispatched", free=free, created_at=at
        )
    )
    _changed(session, out, StatusChange(job_id, number + 1, "queued", reason, text))
    out.to_send.append((job_id, number + 1))
    return out


def _gang_failures(session: Session, job_id: str) -> int:
    """How many of the job's attempts ended because their gang did not start."""
    return int(
        session.execute(
            select(func.count())
            .select_from(ATTEMPTS)
            .where(ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.reason == "no_worker")
        ).scalar()
        or 0
    )


STOPPED_EARLY = "stopped_early"
EARLY_TEXT = "stopped early by its sweep's pruner (hopeless against the other trials)"


def stop_early(session: Session, job_id: str, *, at: datetime | None = None) -> Outcome:
    """A sweep's pruner stops a trial: a cancel that ends ``stopped_early`` (no retry spent,
    its checkpoints kept, as a cancel's). The caller sets the cancel flag first."""
    return cancel_job(session, job_id, at=at, early=True)


def cancel_job(
    session: Session, job_id: str, *, at: datetime | None = None, early: bool = False
) -> Outcome:
    """Queued: cancelled at once. Running: cancelling, until the worker reports the exit.
    ``early``: stopped_early instead of cancelled (``stop_early``)."""
    at = at or utcnow()
    done, why, said = ("cancelled", "cancelled", None) if not early else (
        STOPPED_EARLY, STOPPED_EARLY, EARLY_TEXT
    )  # fmt: skip
    out = Outcome()
    for _ in range(3):  # a concurrent transition may move the job between read and write
        row = session.execute(
            select(JOBS.c.status, JOBS.c.attempt).where(JOBS.c.id == job_id)
        ).first()
        if row is None or row.status not in ("queued", "running"):
            return out
        if row.status == "queued":
            text = said or "cancelled before it started"
            if _cas_job(
                session,
                job_id,
                row.attempt,
                ("queued",),
                status=done,
                reason=why,
                message=text,
                ended_at=at,
            ):
                # The worker also checks the cancel flag before launching this attempt.
                _cas_attempt(
                    session,
                    job_id,
                    row.attempt,
                    ("dispatched",),
                    status="exited",
                    reason="cancelled",
                    message=text,
                    ended_at=at,
                )
                _changed(session, out, StatusChange(job_id, row.attempt, done, why, text))
                return out
        elif _cas_job(
            session,
            job_id,
            row.attempt,
            ("running",),
            status="cancelling",
            # the reason _settle reads to end it stopped_early
            **({"reason": STOPPED_EARLY} if early else {}),
        ):
            _changed(session, out, StatusChange(job_id, row.attempt, "cancelling"))
            return out
    return out
