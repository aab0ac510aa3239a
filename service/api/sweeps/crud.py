"""Sweep rows: create, read with their trials, list, cancel."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from service.api.core.auth import Principal
from service.api.core.models import JOBS, METRICS, SWEEPS, TERMINAL, new_job_id, utcnow
from service.api.events.record import record_event
from service.api.jobs.state import Outcome, cancel_job
from service.api.sweeps.schemas import SweepIn, SweepOut, TrialOut
from service.api.sweeps.sweeper import finish_sweep, trial_number

__all__ = ["cancel_sweep", "create_sweep", "get_sweep", "list_sweeps", "sweep_out"]


def create_sweep(
    session: Session, principal: Principal, body: SweepIn, base: dict[str, Any]
) -> str:
    """Insert a running sweep (``base``: the validated, resolved job spec); its id. The
    sweeper proposes its first trials on its next pass."""
    sweep_id = new_job_id()
    with session.begin():
        session.execute(
            insert(SWEEPS).values(
                id=sweep_id,
                owner=principal.name,
                name=body.name,
                base=base,
                space={path: p.model_dump(mode="json") for path, p in body.space.items()},
                method=body.method,
                metric=body.metric,
                goal=body.goal,
                budget=body.budget,
                parallelism=body.parallelism,
                seed=body.seed,
                early_stop=body.early_stop.model_dump(mode="json") if body.early_stop else None,
                study=None,
                proposed=0,
                status="running",
                created_at=utcnow(),
            )
        )
        record_event(
            session,
            owner=principal.name,
            type="sweep.created",
            data={"sweep_id": sweep_id, "name": body.name, "method": body.method},
        )
    return sweep_id


def _row(session: Session, principal: Principal, sweep_id: str) -> Any:
    stmt = select(SWEEPS).where(SWEEPS.c.id == sweep_id)
    if not principal.admin:
        stmt = stmt.where(SWEEPS.c.owner == principal.name)
    return session.execute(stmt).first()


def _trials(session: Session, sweep: Any) -> list[TrialOut]:
    jobs = list(
        session.execute(
            select(
                JOBS.c.id, JOBS.c.status, JOBS.c.params, JOBS.c.idempotency_key,
                JOBS.c.last_metrics, JOBS.c.last_step,
            ).where(JOBS.c.sweep == sweep.id)
        )
    )  # fmt: skip
    metric = sweep.metric
    best: dict[str, float] = {}
    if jobs:  # each trial's best value, found by the database (not every point read here)
        value = METRICS.c.data[metric].as_float()
        pick = func.min(value) if sweep.goal == "min" else func.max(value)
        for job_id, found in session.execute(
            select(METRICS.c.job_id, pick)
            .where(METRICS.c.job_id.in_([j.id for j in jobs]))
            .group_by(METRICS.c.job_id)
        ):
            if found is not None:
                best[job_id] = float(found)
    out = [
        TrialOut(
            number=trial_number(j.idempotency_key) or 0,  # a sweep's jobs all carry one
            job_id=j.id,
            status=j.status,
            params=j.params or {},
            value=(j.last_metrics or {}).get(metric),
            best=best.get(j.id),
            step=j.last_step,
        )
        for j in jobs
    ]
    return sorted(out, key=lambda t: t.number)


def sweep_out(session: Session, sweep: Any) -> SweepOut:
    trials = _trials(session, sweep)
    done = [t for t in trials if t.status == "succeeded" and t.value is not None]
    pick = min if sweep.goal == "min" else max
    best = pick(done, key=lambda t: t.value) if done else None  # type: ignore[arg-type,return-value]
    return SweepOut.model_validate({**sweep._mapping, "trials": trials, "best_trial": best})


def get_sweep(session: Session, principal: Principal, sweep_id: str) -> SweepOut | None:
    row = _row(session, principal, sweep_id)
    return sweep_out(session, row) if row is not None else None


def list_sweeps(session: Session, principal: Principal, limit: int) -> list[SweepOut]:
    stmt = select(SWEEPS).order_by(SWEEPS.c.id.desc()).limit(limit)
    if not principal.admin:
        stmt = stmt.where(SWEEPS.c.owner == principal.name)
    return [sweep_out(session, r) for r in session.execute(stmt).all()]


def cancel_sweep(session: Session, sweep_id: str) -> tuple[Outcome, list[str]]:
    """End the sweep (cancelled) and cancel its trials that have not ended; (the changes,
    the trials to signal). The sweep's end is committed first: a pass that holds the sweep's
    row finishes first, so the trials it made are seen here."""
    with session.begin():
        finish_sweep(session, sweep_id, "cancelled", "cancelled by its owner")
    out = Outcome()
    live = []
    with session.begin():
        for job_id, status in session.execute(
            select(JOBS.c.id, JOBS.c.status).where(JOBS.c.sweep == sweep_id)
        ):
            if status not in TERMINAL and status != "cancelling":
                out.extend(cancel_job(session, job_id))
                live.append(job_id)
    return out, live
