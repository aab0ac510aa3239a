"""Workers: the live ones, from the registry each worker refreshes in Redis."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from service.api.deps import PrincipalDep, ServicesDep
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


@router.get("/v1/workers", response_model=WorkerList, responses=errors(401))
def list_workers(services: ServicesDep, _: PrincipalDep) -> Response:
    """Live workers (seen in the last 15 s): queues, slots, GPUs and running jobs."""
    found = [_worker(info) for info in services.live_workers(max_age_s=0)]
    items = sorted((w for w in found if w is not None), key=lambda w: w.name)
    return Response(WorkerList(items=items).model_dump_json(), media_type="application/json")
