"""Fixtures for the service: an app on the session's PostgreSQL (migrated once) and Redis,
with tokens; helpers live in ``tests.api.support``.

Tests share one PostgreSQL database, so each test works under its own token names (owners)
and its own Redis key prefix, and the jobs a test made are deleted after it (the reconciler
scans every attempt in the store).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.core import migrate
from service.api.core.deps import Services
from service.api.core.settings import Settings
from tests.api.support import Api, WorkerSim, forget_jobs_since, make_tokens


@pytest.fixture(scope="session")
def pg_migrated(pg_url: str) -> str:
    migrate.upgrade(pg_url)
    return pg_url


@pytest.fixture(scope="session")
def broker_url(redis_dbs: Any) -> str:
    """The Celery broker: a Redis database of its own, as in a deployment."""
    return str(redis_dbs.url(redis_dbs.claim()))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "tiny").mkdir()
    return root


@pytest.fixture()
def make_settings(
    pg_migrated: str, redis_url: str, broker_url: str, data_root: Path, tmp_path: Path
) -> Callable[..., Settings]:
    prefix = f"tq{uuid.uuid4().hex[:8]}"

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": pg_migrated,
            "redis_url": redis_url,
            "broker_url": broker_url,
            "redis_prefix": prefix,
            "data_root": data_root,
            "runs_root": tmp_path / "runs",
            "auth": "on",
            "ingest": False,
            "reconcile": False,
            "webhook_deliver": False,  # tests/api/test_webhooks.py starts its own
            # Submit sends at once (the fifo scheduler): these tests drive dispatch, the
            # reconciler and the ingestor directly; test_admit.py drives the admitter.
            "scheduler": "fifo",
            "consumer_name": "test-consumer",
            "ingest_claim_idle_ms": 60_000,
            "heartbeat_grace_s": 0,
            "unsent_grace_s": 0,
            "dispatch_backoff_s": 0,
            "sse_ping_s": 0.5,
            "redis_timeout_s": 1.0,
            "db_timeout_s": 2.0,
        }
        values.update(overrides)
        return Settings(**values)

    return build


@pytest.fixture()
def api(make_settings: Callable[..., Settings]) -> Iterator[Api]:
    started_ms = int(time.time() * 1000)
    settings = make_settings()
    forget_jobs_since(settings.database_url, 0)  # whatever an interrupted run left behind
    app = create_app(settings)
    services: Services = app.state.services
    user, token, other, admin = make_tokens(services)
    with TestClient(app) as client:
        yield Api(app, client, services, user, token, other, admin)
    forget_jobs_since(settings.database_url, started_ms)


@pytest.fixture()
def sim(api: Api) -> Callable[..., WorkerSim]:
    def build(job_id: str, attempt: int = 1) -> WorkerSim:
        return WorkerSim(api.services.redis, api.keys, job_id, attempt)

    return build
