"""What a route gets: the process's services, and the caller's principal.

``Services`` is built once by ``create_app`` and hung on ``app.state``; routes reach it through
``ServicesDep`` (``Annotated`` aliases, as in full-stack-fastapi-template). The principal
dependency is async and touches the database only on a token-cache miss, so the hot GET path
makes no extra thread hop for auth.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import ANONYMOUS, Principal, TokenCache
from service.api.core.db import AsyncReader
from service.api.core.settings import Settings
from service.api.generation.inflight import InFlight
from service.api.jobs.submit import GroupCommit
from service.api.scheduling.decide import live_entries
from service.api.scheduling.dispatch import Dispatcher
from service.api.scheduling.ratelimit import SubmitLimits
from service.api.streams.sse import StreamHub
from trainer.events import Keys

__all__ = ["PrincipalDep", "Services", "ServicesDep", "get_principal", "get_services"]


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    reader: Engine  # autocommit Core connections: a read is one round trip, no ORM on the way
    redis: Any  # redis.Redis: short commands from sync routes and the background loops
    aredis: Any  # redis.asyncio.Redis: the fan-outs' blocking XREADs, followers' backlogs
    hub: StreamHub  # one reader per followed job stream in this process
    areader: AsyncReader | None  # PostgreSQL reads on the event loop (None on SQLite)
    dispatcher: Dispatcher
    submits: GroupCommit | None  # concurrent submits committed together (None on SQLite)
    tokens: TokenCache
    keys: Keys
    inflight: InFlight  # generations in flight by owner, in Redis (service.api.generation)
    _workers: tuple[float, list[dict[str, Any]]] = (0.0, [])
    _workers_lock: threading.Lock = field(default_factory=threading.Lock)
    limits: SubmitLimits | None = None  # per-owner submit limits (service.api.scheduling.ratelimit)

    def live_workers(self, max_age_s: float = 1.0) -> list[dict[str, Any]]:
        """Workers seen within ``worker_stale_s``; cached briefly (pending reasons)."""
        now = time.time()
        fetched_at, cached = self._workers
        if now - fetched_at < max_age_s:
            return cached
        return self._parse_workers(self.redis.hgetall(self.keys.workers), now)

    async def alive_workers(self, max_age_s: float = 1.0) -> list[dict[str, Any]]:
        """``live_workers`` from the event loop (the follow client's pool)."""
        now = time.time()
        fetched_at, cached = self._workers
        if now - fetched_at < max_age_s:
            return cached
        return self._parse_workers(await self.aredis.hgetall(self.keys.workers), now)

    def _parse_workers(self, raw: dict[Any, Any], now: float) -> list[dict[str, Any]]:
        workers = live_entries(raw, now, self.settings.worker_stale_s)
        with self._workers_lock:
            self._workers = (now, workers)
        return workers


async def get_services(request: Request) -> Services:
    # async on purpose: a plain def dependency costs a thread-pool hop per request.
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_principal(request: Request) -> Principal:
    services: Services = request.app.state.services
    if not services.settings.auth_enabled:
        return ANONYMOUS
    header = request.headers.get("authorization")
    tokens = services.tokens
    try:
        return tokens.resolve_cached(header)
    except LookupError:
        if services.areader is not None:
            return await tokens.aresolve(header, services.areader)
        return await run_in_threadpool(tokens.resolve, header)


PrincipalDep = Annotated[Principal, Depends(get_principal)]
