"""Idempotency under concurrency: a real uvicorn on PostgreSQL, submits from many threads."""

from __future__ import annotations

import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from sqlalchemy import func, select

from service.api.app import create_app
from service.api.core.models import JOBS
from tests.api.support import Api, Uvicorn


def test_200_concurrent_submits_with_100_keys_make_100_jobs(
    api: Api, make_settings: Callable[..., Any]
) -> None:
    app = create_app(make_settings(redis_prefix=api.settings.redis_prefix, db_pool_size=20))
    requests = [f"key-{i % 100}" for i in range(200)]
    random.Random(7).shuffle(requests)
    local = threading.local()
    clients: list[httpx.Client] = []

    with Uvicorn(app) as server:

        def submit(key: str) -> tuple[str, int, str]:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=server.url, timeout=30)
                clients.append(local.client)
            body = {"name": f"job-{key}", "queue": api.queue, "train": {"steps": 2}}
            resp = local.client.post(
                "/v1/jobs", json=body, headers={**api.headers(), "Idempotency-Key": key}
            )
            return key, resp.status_code, resp.json().get("id", resp.text)

        try:
            with ThreadPoolExecutor(max_workers=32) as pool:
                results = list(pool.map(submit, requests))
        finally:
            for client in clients:
                client.close()

    codes = Counter(code for _, code, _ in results)
    assert codes == {201: 100, 200: 100}, codes
    ids_per_key: dict[str, set[str]] = defaultdict(set)
    for key, _, job_id in results:
        ids_per_key[key].add(job_id)
    assert len(ids_per_key) == 100 and all(len(ids) == 1 for ids in ids_per_key.values())
    with api.services.sessions() as session:
        stored = session.execute(
            select(func.count()).select_from(JOBS).where(JOBS.c.owner == api.user)
        ).scalar_one()
    assert stored == 100
