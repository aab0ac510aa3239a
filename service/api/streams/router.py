"""What a job reports: its metrics (JSON or CSV), its logs (tail, follow), its live events."""

from __future__ import annotations

import csv
import io
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep, get_principal
from service.api.core.errors import NotFound, Unauthorized
from service.api.core.inputs import JobId
from service.api.core.models import JOBS
from service.api.core.responses import errors
from service.api.jobs import crud
from service.api.streams import reports
from service.api.streams.schemas import METRIC_FIELDS, MetricPoint, MetricsOut
from service.api.streams.sse import (
    Follower,
    follow_logs,
    format_log_line,
    format_sse,
    is_entry_id,
    sse_events,
)

__all__ = ["downsample", "router", "stream_route"]

router = APIRouter(tags=["jobs"])

CSV_COLUMNS = ("step", "attempt", "ts", *METRIC_FIELDS)
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# The stream routes' inputs, bounded here once: the routes declare them, ``stream_route``
# (the app's edge) recognises a stream request whose inputs those declarations accept.
EVENTS_PATH, LOGS_PATH = "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/logs"
EVENTS_TAIL_MAX, LOGS_TAIL_MAX, RANK_MAX, ATTEMPT_MAX, LAST_EVENT_ID_MAX = (
    100_000,
    1_000_000,
    1_000_000,
    1000,
    64,
)
_STREAM = re.compile(r"/v1/jobs/[0-9a-f]{1,32}/(events|logs)")
_DIGITS = re.compile(r"[0-9]{1,7}")
_EDGE_QUERY = {
    EVENTS_PATH: {"tail": (0, EVENTS_TAIL_MAX)},
    LOGS_PATH: {"tail": (0, LOGS_TAIL_MAX), "rank": (0, RANK_MAX), "attempt": (1, ATTEMPT_MAX)},
}


def stream_route(path: str, query: bytes, last_event_id: list[bytes]) -> str | None:
    """The route (``EVENTS_PATH`` or ``LOGS_PATH``) of a request that opens a stream and whose
    inputs the route accepts as they are, or None. Conservative: anything unusual (a repeated
    or unknown parameter, ``follow=yes``) is None, and the routed path answers it."""
    match = _STREAM.fullmatch(path)
    if match is None:
        return None
    route = EVENTS_PATH if match.group(1) == "events" else LOGS_PATH
    if route == EVENTS_PATH and (
        len(last_event_id) > 1 or any(len(v) > LAST_EVENT_ID_MAX for v in last_event_id)
    ):
        return None
    try:
        params = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    bounds = _EDGE_QUERY[route]
    follow = route == EVENTS_PATH
    seen: set[str] = set()
    for name, value in params:
        if name in seen:
            return None
        seen.add(name)
        if route == LOGS_PATH and name == "follow" and value in ("true", "1"):
            follow = True
            continue
        low, high = bounds.get(name, (1, 0))  # an unknown name: no value is in bounds
        if _DIGITS.fullmatch(value) is None or not low <= int(value) <= high:
            return None
    return route if follow else None


def downsample(points: list[Any], max_points: int) -> list[Any]:
    """Evenly spaced points, always keeping the first and the last."""
    n = len(points)
    if n <= max_points:
        return points
    if max_points == 1:
        return [points[-1]]
    picks = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [points[i] for i in picks]


def _require(services: Services, principal: Principal, job_id: str) -> None:
    with services.reader.connect() as session:
        if not crud.job_exists(session, principal, job_id):
            raise NotFound(f"job {job_id} not found")


def _slot(services: Services, principal: Principal) -> Callable[[], None]:
    """Count a new stream against the stream limits before anything else (a 429 beyond):
    a refused stream costs no SQL, no thread-pool hop and no Redis call. Most refusals do
    not get here: the app's edge gives the same 429 before routing (``stream_route``)."""
    return services.hub.admit(principal.name)


async def _follow(
    services: Services, job_id: str, cursor: str, release: Callable[[], None]
) -> Follower:
    """A follower of the job's stream that gives its slot (``_slot``) back when it closes."""
    follower = await services.hub.follow(
        services.keys.job(job_id), cursor, _status_reader(services, job_id)
    )
    follower.on_close = release
    return follower


async def _guarded(
    request: Request, services: Services, chunks: AsyncIterator[bytes], *, sse: bool
) -> AsyncIterator[bytes]:
    """A stream that ends when its token is revoked (checked at least every
    ``token_cache_s``, as often as a request's own check would notice) or when it is
    ``sse_max_lifetime_s`` old (the client resumes with Last-Event-ID)."""
    settings = services.settings
    now = time.monotonic()
    ends_at = now + settings.sse_max_lifetime_s
    recheck_at = now + settings.token_cache_s
    try:
        async for chunk in chunks:
            if chunk:
                yield chunk
            now = time.monotonic()
            if now >= ends_at:
                return
            if settings.auth_enabled and now >= recheck_at:
                recheck_at = now + settings.token_cache_s
                try:
                    await get_principal(request)
                except Unauthorized:
                    if sse:
                        yield format_sse("error", {"message": "token revoked; stream closed"})
                    return
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _entry_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _tick_s(services: Services) -> float:
    """How often a quiet stream wakes for its checks."""
    settings = services.settings
    return max(0.5, min(settings.token_cache_s or 1.0, settings.sse_max_lifetime_s))


def _status_reader(services: Services, job_id: str) -> Any:
    def status() -> str | None:
        with services.reader.connect() as session:
            return session.execute(select(JOBS.c.status).where(JOBS.c.id == job_id)).scalar()

    return status


@router.get(
    "/v1/jobs/{job_id}/metrics",
    response_model=MetricsOut,
    responses={
        200: {"content": {"text/csv": {"schema": {"type": "string"}}}},
        **errors(401, 404),
    },
)
def job_metrics(
    job_id: JobId,
    services: ServicesDep,
    principal: PrincipalDep,
    since_step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    format: Literal["json", "csv"] = "json",
) -> Response:
    """Metric points by step (a resumed attempt's points replace the earlier ones), downsampled."""
    with services.reader.connect() as session:
        if not crud.job_exists(session, principal, job_id):
            raise NotFound(f"job {job_id} not found")
        points, total = reports.metric_points(session, job_id, since_step, max_points)
    if format == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for r in points:
            data = r["data"]
            writer.writerow(
                [
                    r["step"],
                    r["attempt"],
                    r["ts"],
                    *("" if data.get(f) is None else data.get(f) for f in METRIC_FIELDS),
                ]
            )
        return Response(buf.getvalue(), media_type="text/csv")
    out = MetricsOut(
        job_id=job_id,
        total=total,
        downsampled=len(points) < total,
        points=[
            MetricPoint.model_validate(
                {**r["data"], "step": r["step"], "attempt": r["attempt"], "ts": r["ts"]}
            )
            for r in points
        ],
    )
    return Response(out.model_dump_json(), media_type="application/json")


def _log_tail(
    services: Services,
    principal: Principal,
    job_id: str,
    tail: int | None,
    rank: int | None,
    attempt: int | None,
    follow: bool,
) -> tuple[list[str], dict[tuple[int, int], int]]:
    def lines_of(chunk: Any) -> list[str]:
        return [
            format_log_line(x, chunk["attempt"])
            for x in chunk["lines"]
            if rank is None or x.get("rank") == rank
        ]

    with services.reader.connect() as session:
        if not crud.job_exists(session, principal, job_id):
            raise NotFound(f"job {job_id} not found")
        lines: list[str] = []
        if tail is None:
            for chunk in reports.log_chunks(session, job_id, attempt):
                lines.extend(lines_of(chunk))
        elif tail:
            # Newest chunks first, and stop once there are enough lines.
            picked: list[list[str]] = []
            count = 0
            for chunk in reports.log_chunks(session, job_id, attempt, newest_first=True):
                picked.append(lines_of(chunk))
                count += len(picked[-1])
                if count >= tail:
                    break
            lines = [line for chunk_lines in reversed(picked) for line in chunk_lines][-tail:]
        seen = reports.log_marks(session, job_id) if follow else {}
    return lines, seen


@router.get(
    LOGS_PATH,
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **errors(401, 404, 429),
    },
)
async def job_logs(
    request: Request,
    job_id: JobId,
    services: ServicesDep,
    principal: PrincipalDep,
    tail: Annotated[int | None, Query(ge=0, le=LOGS_TAIL_MAX)] = None,
    follow: bool = False,
    rank: Annotated[int | None, Query(ge=0, le=RANK_MAX)] = None,
    attempt: Annotated[int | None, Query(ge=1, le=ATTEMPT_MAX)] = None,
) -> Response:
    """Log lines as text, one per line tagged with its attempt and rank (``[a1 rank 0]``);
    follow=true keeps streaming until the end."""
    if not follow:
        lines, _ = await run_in_threadpool(
            _log_tail, services, principal, job_id, tail, rank, attempt, False
        )
        return Response("".join(lines), media_type="text/plain; charset=utf-8")
    release = _slot(services, principal)
    try:
        lines, seen = await run_in_threadpool(
            _log_tail, services, principal, job_id, tail, rank, attempt, True
        )
        follower = await _follow(services, job_id, "0-0", release)
    except BaseException:
        release()
        raise

    async def body() -> AsyncIterator[bytes]:
        if lines:
            yield "".join(lines).encode()
        async for chunk in follow_logs(follower, seen, rank, _tick_s(services)):
            yield chunk

    return StreamingResponse(
        _guarded(request, services, body(), sse=False),
        media_type="text/plain; charset=utf-8",
        headers=STREAM_HEADERS,
    )


@router.get(
    EVENTS_PATH,
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "status, lifecycle, metric and log events; ends after the final status",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **errors(401, 404, 429),
    },
)
async def job_events(
    request: Request,
    job_id: JobId,
    services: ServicesDep,
    principal: PrincipalDep,
    last_event_id: Annotated[str | None, Header(max_length=LAST_EVENT_ID_MAX)] = None,
    tail: Annotated[
        int | None,
        Query(
            ge=0, le=EVENTS_TAIL_MAX, description="replay only the last N events (no Last-Event-ID)"
        ),
    ] = None,
) -> StreamingResponse:
    """Server-Sent Events of a job; the id is the Redis entry id, so Last-Event-ID resumes."""
    release = _slot(services, principal)
    try:
        await run_in_threadpool(_require, services, principal, job_id)
        cursor = last_event_id if last_event_id and is_entry_id(last_event_id) else "0-0"
        if tail is not None and cursor == "0-0":
            # Start after the entry N+1 from the end: a page opens a long job with the
            # recent events, its history from the metrics and logs routes.
            newest = await services.aredis.xrevrange(services.keys.job(job_id), count=tail + 1)
            if len(newest) == tail + 1:
                cursor = _entry_text(newest[-1][0])
        follower = await _follow(services, job_id, cursor, release)
    except BaseException:
        release()
        raise
    return StreamingResponse(
        _guarded(request, services, sse_events(follower, _tick_s(services)), sse=True),
        media_type="text/event-stream",
        headers=STREAM_HEADERS,
    )
