"""Workers: the live ones, from the registry each worker refreshes in Redis."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import func, select

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.models import ATTEMPTS, JOBS
from service.api.core.responses import errors
from service.api.scheduling.decide import capacity
from service.api.scheduling.schemas import QueueList, QueueOut, WorkerList, WorkerOut

__all__ = ["router"]

router = APIRouter(tags=["workers"])


def _worker(info: dict[str, Any]) -> WorkerOut | None:
    try:
        return WorkerOut.model_validate(
            {
                "name": str(info.get("name")),
                "host": info.get("host") if isinstance(info.get("host"), str) else None,
                "queues": [q for q in info.get("queues") or [] if isinstance(q, str)],
                "slots": info.get("slots") if isinstance(info.get("slots"), int) else None,
                "gpus": [g for g in info.get("gpus") or [] if isinstance(g, int)],
                "running": [j for j in info.get("running") or [] if isinstance(j, str)],
                "ts": info["ts"],
                "age_s": info["age_s"],
            }
        )
    except (ValueError, TypeError, KeyError):
        return None  # a malformed registry entry is not shown


def _visible(services: Services, principal: Principal, job_ids: set[str]) -> set[str]:
    """The ids among ``job_ids`` of jobs the principal may see (an admin: all)."""
    if principal.admin or not job_ids:
        return job_ids
    with services.reader.connect() as conn:
        rows = conn.execute(
            select(JOBS.c.id).where(JOBS.c.id.in_(sorted(job_ids)), JOBS.c.owner == principal.name)
        )
        return {r[0] for r in rows}


@router.get("/v1/workers", response_model=WorkerList, responses=errors(401))
def list_workers(services: ServicesDep, principal: PrincipalDep) -> Response:
    """Live workers (seen in the last 15 s): queues, slots, GPUs, busy slots, and which of
    your jobs run there (other owners' jobs are counted in ``busy``, not named)."""
    found = [w for w in (_worker(info) for info in services.live_workers(max_age_s=0)) if w]
    visible = _visible(services, principal, {j for w in found for j in w.running})
    items = sorted(
        (
            w.model_copy(
                update={"busy": len(w.running), "running": [j for j in w.running if j in visible]}
            )
            for w in found
        ),
        key=lambda w: w.name,
    )
    return Response(WorkerList(items=items).model_dump_json(), media_type="application/json")


@router.get("/v1/queues", response_model=QueueList, responses=errors(401))
def list_queues(services: ServicesDep, principal: PrincipalDep) -> Response:
    """Each queue's capacity (live workers, slots, free slots, slot size, GPUs), its use, and
    its queued jobs by owner and priority (the admission order's inputs:
    service.api.scheduling.admit).
    Queues that only have jobs (no worker) are listed too, with zero capacity. Other owners
    are an admin's to see: anyone else reads their jobs as counts (``owner`` null), and
    does not see a queue that only other owners' jobs name."""
    # The admitter's reading of each entry (a malformed one is left out, as it leaves it out).
    workers = [
        cap
        for w in services.live_workers(max_age_s=0)
        if not w.get("draining") and (cap := capacity(str(w["name"]), w)) is not None
    ]
    with services.reader.connect() as conn:
        queued = list(
            conn.execute(
                select(JOBS.c.queue, JOBS.c.owner, JOBS.c.priority, func.count())
                .join(ATTEMPTS, ATTEMPTS.c.job_id == JOBS.c.id)
                .where(JOBS.c.status == "queued", ATTEMPTS.c.number == JOBS.c.attempt)
                .where(ATTEMPTS.c.placement.is_(None))  # placed ones hold capacity already
                .group_by(JOBS.c.queue, JOBS.c.owner, JOBS.c.priority)
            )
        )
        live = ATTEMPTS.c.status.in_(("dispatched", "running"))
        held = list(
            conn.execute(
                select(
                    JOBS.c.queue,
                    JOBS.c.owner,
                    func.count(),
                    func.sum(JOBS.c.nodes),
                    func.sum(JOBS.c.nodes * JOBS.c.procs_per_node),
                )
                .join(ATTEMPTS, ATTEMPTS.c.job_id == JOBS.c.id)
                .where(live, ATTEMPTS.c.number == JOBS.c.attempt)
                .where((ATTEMPTS.c.status == "running") | ATTEMPTS.c.placement.is_not(None))
                .group_by(JOBS.c.queue, JOBS.c.owner)
            )
        )
    me = None if principal.admin else principal.name

    def shown(owner: str) -> str | None:
        return owner if me is None or owner == me else None

    names = {q for w in workers for q in w.queues}
    names |= {r[0] for r in queued + held if me is None or r[1] == me}
    items = []
    for name in sorted(names):
        serving = [w for w in workers if name in w.queues]
        gpu = any(w.gpus_per_slot for w in serving)
        waiting: dict[tuple[int, str | None], int] = defaultdict(int)
        for r in queued:
            if r[0] == name:
                waiting[(int(r[2]), shown(r[1]))] += int(r[3])
        running: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
        for r in held:
            if r[0] == name:
                group = running[shown(r[1])]
                group[0] += int(r[2])
                group[1] += int(r[4] if gpu else r[3])
        items.append(
            QueueOut(
                name=name,
                workers=len(serving),
                slots=sum(w.slots for w in serving),
                free_slots=sum(w.free for w in serving),
                largest_slot_procs=max((w.slot_procs for w in serving), default=0),
                gpus=sum(w.gpus_per_slot * w.slots for w in serving),
                queued=sum(waiting.values()),
                running=sum(jobs for jobs, _ in running.values()),
                queued_by=[
                    {"owner": owner, "priority": prio, "jobs": jobs}
                    for (prio, owner), jobs in sorted(
                        waiting.items(), key=lambda kv: (-kv[0][0], _last(kv[0][1]))
                    )
                ],
                running_by=[
                    {"owner": owner, "jobs": jobs, "units": n}
                    for owner, (jobs, n) in sorted(running.items(), key=lambda kv: _last(kv[0]))
                ],
            )
        )
    return Response(QueueList(items=items).model_dump_json(), media_type="application/json")


def _last(owner: str | None) -> tuple[bool, str]:
    """Sort key: owners by name, the other owners' group (None) last."""
    return (owner is None, owner or "")
