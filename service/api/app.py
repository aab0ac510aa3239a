"""The FastAPI application: ``create_app(settings)`` builds one, ``app`` is the default.

Building an app does no I/O: the engine and Redis clients connect on first use, so importing
this module is cheap and never loads torch or Celery. The lifespan starts the ingestor and the
reconciler as daemon threads when ``TRAINQ_INGEST`` / ``TRAINQ_RECONCILE`` are on (tests turn
them off and drive both directly). Errors become HTTP here, at the edge: the service's own
exception tree (``service.api.core.errors``), database and Redis outages as 503 with a one-line
message, request validation as 422 naming the field; nothing leaks a traceback.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api import dashboard
from service.api.checkpoints import router as checkpoint_routes
from service.api.core import health, telemetry
from service.api.core.auth import ANONYMOUS, Principal, TokenCache
from service.api.core.db import make_async_reader, make_engine, make_sessionmaker
from service.api.core.deps import Services
from service.api.core.errors import (
    Gone,
    InvalidInput,
    PayloadTooLarge,
    TooManyRequests,
    TrainqError,
    Unauthorized,
)
from service.api.core.settings import Settings
from service.api.datasets import router as dataset_routes
from service.api.datasets.work import DatasetWork
from service.api.events import router as event_routes
from service.api.generation import openai_errors
from service.api.generation import router as generate
from service.api.generation.inflight import InFlight
from service.api.jobs import router as jobs
from service.api.jobs.submit import GroupCommit
from service.api.scheduling import router as workers
from service.api.scheduling.admit import Admitter
from service.api.scheduling.dispatch import Dispatcher
from service.api.scheduling.ratelimit import SubmitLimits
from service.api.scheduling.reconcile import Reconciler
from service.api.scheduling.retention import Retention
from service.api.streams import router as streams
from service.api.streams.ingest import Ingestor
from service.api.streams.sse import StreamHub
from service.api.sweeps import router as sweeps
from service.api.sweeps.sweeper import Sweeper
from service.api.webhooks import router as webhook_routes
from service.api.webhooks.delivery import Deliverer
from trainer.events import Keys

__all__ = ["app", "build_services", "create_app", "error_response"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DESCRIPTION = (
    "Submit distributed PyTorch training jobs, follow their status, metrics and logs. "
    "Authenticate with `Authorization: Bearer TOKEN` (`trainq token create`)."
)


# A GET the edge answered itself: the route it stands for and the status; None: route it.
FastGet = Callable[[Scope, Receive, Send], Awaitable[tuple[str, int] | None]]


class EdgeMiddleware:
    """Body limit, request timing and the fast GETs, as plain ASGI (no per-request task or
    copy).

    ``GET /healthz`` is answered here first, then each of ``fast_gets`` may answer a GET
    before routing (``FastJobGet``, ``StreamRefusal``). A Content-Length over the limit is
    refused before the app runs; a body streamed without one is counted as it arrives and
    refused (PayloadTooLarge, a 413) once it passes.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body: int,
        observe: Callable[..., None],
        fast_gets: tuple[FastGet, ...] = (),
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.observe = observe
        self.fast_gets = fast_gets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        if scope["method"] == "GET":
            if scope["path"] == health.HEALTHZ_PATH:
                status = await health.answer_healthz(send)
                self.observe("GET", health.HEALTHZ_PATH, status, time.perf_counter() - start)
                return
            for fast_get in self.fast_gets:
                answered = await fast_get(scope, receive, send)
                if answered is not None:
                    self.observe("GET", *answered, time.perf_counter() - start)
                    return
        limit = self.max_body
        if scope["method"] == "POST" and scope["path"] == dataset_routes.UPLOAD_PATH:
            limit = sys.maxsize  # streamed to disk; the route enforces the dataset limits
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    await _send_413(send, limit, scope["path"])
                    return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"request body is larger than {limit} bytes")
            return message

        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted, timed_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.observe(scope["method"], path, status, time.perf_counter() - start)


async def _edge_principal(services: Services, scope: Scope) -> Principal | None:
    """The caller as ``get_principal`` resolves it (the token cache, then PostgreSQL on the
    event loop), or None where that would take a thread-pool hop (SQLite) or fails: a missing,
    unknown or revoked token, an outage. None leaves the request to the routed path, which
    answers it properly (a 401 before anything else)."""
    if not services.settings.auth_enabled:
        return ANONYMOUS
    header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
    authorization = header.decode("latin-1") if header is not None else None
    try:
        if services.areader is not None:
            return await services.tokens.aresolve(authorization, services.areader)
        return services.tokens.resolve_cached(authorization)  # LookupError on a miss
    except Exception:  # Unauthorized, a miss on SQLite, an outage: the routed path answers
        return None


class FastJobGet:
    """``GET /v1/jobs/{id}`` answered without FastAPI's routing and dependency solving: the
    hot read of every client's polling loop. Only the plain case is taken here (a well-formed
    id, a known token or auth off, PostgreSQL, the job found); anything else (bad input, an
    unknown token, a 404, the database away) returns None having sent nothing, and the request
    goes through the routed ``get_job``, which answers it (and documents it in OpenAPI). The
    answer is built by the same function the route uses, so the two cannot differ."""

    PATH = "/v1/jobs/{job_id}"
    _ID = re.compile(r"/v1/jobs/([0-9a-f]{1,32})")

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> tuple[str, int] | None:
        services = self.services
        match = self._ID.fullmatch(scope["path"])
        if match is None or services.areader is None:
            return None
        principal = await _edge_principal(services, scope)
        if principal is None:
            return None
        try:
            response = await jobs.get_job_answer(services, principal, match.group(1))
        except Exception:  # NotFound, an outage: the routed path answers it properly
            return None
        await response(scope, receive, send)
        return self.PATH, response.status_code


class StreamRefusal:
    """A stream (``/events``, ``/logs?follow=true``) past the stream limits refused before
    routing: the 429 the route would give (``StreamHub.refusal``, the check ``admit`` counts
    by, made into the answer by ``error_response``, as the routed one is), at the cost of a
    token-cache hit, so a burst of refused streams costs the process little more than their
    connections. Only a request the route would accept as it is (``stream_route``) by a
    caller the edge can name; anything else returns None, and the route answers it (401
    before 429, 422 before 429). An admitted stream is counted by the route, not here."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> tuple[str, int] | None:
        headers = scope["headers"]
        route = streams.stream_route(
            scope["path"], scope["query_string"], [v for k, v in headers if k == b"last-event-id"]
        )
        if route is None:
            return None
        principal = await _edge_principal(self.services, scope)
        if principal is None:
            return None
        refused = self.services.hub.refusal(principal.name)
        if refused is None:
            return None
        response = error_response(refused)
        await response(scope, receive, send)
        return route, response.status_code


async def _send_413(send: Send, limit: int, path: str) -> None:
    """413 before the app runs: in OpenAI's shape on its routes, as every other error there."""
    message = f"request body is larger than {limit} bytes"
    payload: dict[str, Any] = {"detail": message}
    if openai_errors.is_openai_path(path):
        payload = openai_errors.error_body(413, message)
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _error(status: int, detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def error_response(exc: TrainqError) -> JSONResponse:
    """The answer to one of the service's own errors, routed or at the edge."""
    if isinstance(exc, InvalidInput):
        return _error(422, exc.errors)
    if isinstance(exc, Gone):
        return JSONResponse({"detail": exc.errors, **exc.extra}, status_code=410)
    response = _error(exc.status_code, exc.message)
    if isinstance(exc, Unauthorized):
        response.headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, TooManyRequests):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(TrainqError)
    async def _trainq(_: Request, exc: TrainqError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # Bodies are depth-checked before parsing; this is the net under that check.
        log.warning("request too deeply nested: %s", exc)
        msg = "the request is nested too deeply"
        return _error(422, [{"loc": ["body"], "msg": msg, "type": "value_error"}])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers a body it cannot decode (bytes that are not UTF-8 JSON) with a 400
        # of its own; every route documents a body it refuses as a 422 naming the body.
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            msg = "the body is not JSON (UTF-8 encoded)"
            return _error(422, [{"loc": ["body"], "msg": msg, "type": "json_invalid"}])
        response = _error(exc.status_code, exc.detail)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # The pydantic loc names the field; the offending input is not echoed back.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
            for e in exc.errors()
        ]
        return _error(422, errors)

    @app.exception_handler(redis.RedisError)
    async def _redis(_: Request, exc: redis.RedisError) -> JSONResponse:
        log.warning("redis error: %s", exc)
        return _error(503, "Redis is unavailable; try again shortly")

    @app.exception_handler(SQLAlchemyError)
    async def _database(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        if isinstance(exc, DBAPIError | PoolTimeout):
            log.warning("database error: %s", exc.__class__.__name__)
            return _error(503, "the database is unavailable; try again shortly")
        log.exception("unexpected database error")
        return _error(500, "internal error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal error")


def build_services(settings: Settings) -> Services:
    engine = make_engine(settings)
    sessions = make_sessionmaker(engine)
    reader = make_engine(settings, autocommit=True)
    timeout = settings.redis_timeout_s
    sync = redis.Redis.from_url(
        settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    # Followers block in XREAD for up to a ping interval; the socket must wait longer.
    # One connection per followed job (its fan-out), not per follower; followers' short
    # backlog reads wait for a free one (a burst of connects) instead of failing at the bound.
    follow = redis.asyncio.Redis(
        connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
            settings.redis_url,
            socket_timeout=settings.sse_ping_s + timeout,
            socket_connect_timeout=timeout,
            max_connections=settings.sse_redis_connections,
            timeout=timeout,
        )
    )
    areader = make_async_reader(settings)
    dispatcher = Dispatcher(settings)
    return Services(
        settings=settings,
        engine=engine,
        sessions=sessions,
        reader=reader,
        redis=sync,
        aredis=follow,
        areader=areader,
        hub=StreamHub(
            follow,
            ping_s=settings.sse_ping_s,
            queue_size=settings.sse_queue_size,
            max_streams=settings.sse_max_streams,
            max_per_owner=settings.sse_max_streams_per_owner,
        ),
        dispatcher=dispatcher,
        submits=GroupCommit(areader, dispatcher) if areader is not None else None,
        tokens=TokenCache(reader.connect, settings.token_cache_s),
        keys=Keys(settings.redis_prefix),
        limits=SubmitLimits(settings, sync, settings.redis_prefix),
        inflight=InFlight(settings, follow, settings.redis_prefix),
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    services = build_services(settings)
    datasets_work = DatasetWork(settings, services.sessions)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        threads = []
        if settings.ingest:
            ingestor = Ingestor(settings, services.sessions, services.redis, services.dispatcher)
            threads.append(threading.Thread(target=ingestor.run, args=(stop,), name="ingest"))
        if settings.reconcile and settings.scheduler == "admit":
            admitter = Admitter(settings, services.sessions, services.redis, services.dispatcher)
            threads.append(threading.Thread(target=admitter.run, args=(stop,), name="admit"))
        if settings.reconcile:
            reconciler = Reconciler(
                settings, services.sessions, services.redis, services.dispatcher
            )
            threads.append(threading.Thread(target=reconciler.run, args=(stop,), name="reconcile"))
        if settings.reconcile:  # proposes and prunes the sweeps' trials (service.api.sweeps)
            sweeper = Sweeper(settings, services.sessions, services.redis, services.dispatcher)
            threads.append(threading.Thread(target=sweeper.run, args=(stop,), name="sweeps"))
        if settings.reconcile and (
            settings.retention_days > 0 or settings.events_retention_days > 0
        ):
            retention = Retention(settings, services.sessions, services.redis)
            threads.append(threading.Thread(target=retention.run, args=(stop,), name="retention"))
        if settings.webhook_deliver:
            deliverer = Deliverer(settings, services.sessions)
            threads.append(threading.Thread(target=deliverer.run, args=(stop,), name="webhooks"))
        for t in threads:
            t.daemon = True
            t.start()
        # What is loaded by now (modules, the app, pydantic and SQLAlchemy structures) lives
        # as long as the process: kept out of the cyclic collector, whose full passes would
        # otherwise walk all of it, stalling every request in flight (~0.1 s each ~2 s).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=settings.ingest_block_ms / 1000 + 5)
            await datasets_work.close()
            services.dispatcher.close()
            await services.hub.close()
            await services.aredis.aclose()
            await services.aredis.connection_pool.disconnect()
            services.redis.close()
            services.engine.dispose()
            services.reader.dispose()
            if services.areader is not None:
                services.areader.close()

    app = FastAPI(
        title="trainq",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        # /docs is served from the vendored Swagger UI (service.api.dashboard), not a CDN;
        # ReDoc has no vendored copy, so it is off rather than blank.
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = services
    app.state.datasets = datasets_work
    registry, observe = telemetry.build_registry(services)
    app.state.registry = registry
    _install_handlers(app)
    openai_errors.install(app)  # OpenAI's error shape on its routes (after the handlers)
    app.include_router(jobs.router)
    app.include_router(streams.router)
    app.include_router(workers.router)
    app.include_router(checkpoint_routes.router)
    app.include_router(dataset_routes.router)
    app.include_router(sweeps.router)
    app.include_router(generate.router)
    app.include_router(event_routes.router)
    app.include_router(webhook_routes.router)
    app.include_router(health.router)
    app.include_router(dashboard.router)
    app.add_middleware(
        EdgeMiddleware,
        max_body=settings.max_body_bytes,
        observe=observe,
        fast_gets=(FastJobGet(services), StreamRefusal(services)),
    )

    def openapi() -> dict[str, Any]:
        # The submit route reads its body by hand (JSON or YAML); its schema is added here.
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(jobs.openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


app = create_app()
