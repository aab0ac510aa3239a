"""Health: liveness, readiness (the database and Redis answer), Prometheus metrics.

``GET /healthz`` is answered by the app's edge (``answer_healthz``, plain ASGI, before routing
and before any other fast path), so a burst of other requests queues nothing in front of it
but the connections themselves; the route below documents it and gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from service.api.core.deps import ServicesDep, get_principal
from service.api.core.errors import Forbidden
from service.api.core.responses import errors

__all__ = ["HEALTHZ_PATH", "answer_healthz", "router"]

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    database: str
    redis: str


HEALTHZ_PATH = "/healthz"
_HEALTHY = Health(status="ok").model_dump_json().encode()
_HEALTHY_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-length", str(len(_HEALTHY)).encode()),
        (b"content-type", b"application/json"),
    ],
}
_HEALTHY_BODY = {"type": "http.response.body", "body": _HEALTHY}


async def answer_healthz(send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> int:
    """``GET /healthz`` as plain ASGI (the edge's answer); its status."""
    await send(dict(_HEALTHY_START))
    await send(dict(_HEALTHY_BODY))
    return 200


@router.get(HEALTHZ_PATH, response_model=Health)
async def healthz() -> Response:
    """Liveness: the process answers."""
    return Response(_HEALTHY, media_type="application/json")


@router.get(
    "/readyz",
    response_model=Ready,
    responses={503: {"model": Ready, "description": "the database or Redis is unreachable"}},
)
def readyz(services: ServicesDep) -> Response:
    """Readiness: the database and Redis both answer."""
    database = redis = "ok"
    try:
        with services.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to reach it is "not ready", never a 500
        database = f"unavailable: {exc.__class__.__name__}"
    try:
        services.redis.ping()
    except Exception as exc:
        redis = f"unavailable: {exc.__class__.__name__}"
    ok = database == redis == "ok"
    body = Ready(status="ok" if ok else "unavailable", database=database, redis=redis)
    return Response(
        body.model_dump_json(), status_code=200 if ok else 503, media_type="application/json"
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
        **errors(401, 403),
    },
)
async def metrics(request: Request, services: ServicesDep) -> Response:
    """Prometheus metrics (an admin token, unless TRAINQ_METRICS_PUBLIC): jobs by status,
    queue depth, ingest lag, request latency."""
    settings = services.settings
    if settings.auth_enabled and not settings.metrics_public:
        principal = await get_principal(request)
        if not principal.admin:
            raise Forbidden("/metrics needs an admin token (or TRAINQ_METRICS_PUBLIC=true)")
    body = await run_in_threadpool(generate_latest, request.app.state.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
