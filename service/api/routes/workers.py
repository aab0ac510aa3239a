"""Workers: the live ones, from the registry each worker refreshes in Redis."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import select

from service.api.auth import Principal
from service.api.deps import PrincipalDep, Services, ServicesDep
from service.api.models import JOBS
from service.api.routes import errors
from service.api.schemas import WorkerList, WorkerOut

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
