"""Health: liveness, readiness (the database and Redis answer), Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from service.api.core.deps import ServicesDep, get_principal
from service.api.core.errors import Forbidden
from service.api.core.responses import errors

__all__ = ["router"]

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    database: str
    redis: str


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(status="ok")


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
