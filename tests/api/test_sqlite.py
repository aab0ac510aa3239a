"""The embedded default: SQLite (WAL, busy timeout, foreign keys) runs the same lifecycle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from service.api.app import create_app
from service.api.core import migrate
from tests.api.support import Api, WorkerSim, make_tokens


@pytest.fixture()
def sqlite_api(make_settings: Callable[..., Any], tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'embedded' / 'trainq.db'}"
    migrate.upgrade(url)
    app = create_app(make_settings(database_url=url))
    services = app.state.services
    user, token, other, admin = make_tokens(services)
    with TestClient(app) as client:
        yield Api(app, client, services, user, token, other, admin)


def test_sqlite_pragmas(sqlite_api: Api) -> None:
    with sqlite_api.services.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 2000


def test_sqlite_lifecycle_with_retry(sqlite_api: Api) -> None:
    api = sqlite_api
    job = api.submit(retries=1, labels={"env": "laptop"})
    w1 = WorkerSim(api.services.redis, api.keys, job["id"], 1)
    w1.claim()
    w1.running()
    w1.metric(1)
    w1.log((0, "hi"))
    api.drain()
    w1.stop_heartbeat()
    assert api.reconciler().run_once() == {"sent": 0, "lost": 1}
    w2 = WorkerSim(api.services.redis, api.keys, job["id"], 2)
    w2.running()
    w2.metric(2)
    w2.exited(0)
    api.drain()
    got = api.get(job["id"])
    assert got["status"] == "succeeded" and [a["status"] for a in got["attempts"]] == [
        "lost",
        "exited",
    ]
    assert got["created_at"].endswith(("+00:00", "Z"))  # UTC although SQLite stores naive
    listed = api.client.get(
        "/v1/jobs", params={"label": "env:laptop"}, headers=api.headers()
    ).json()
    assert [i["id"] for i in listed["items"]] == [job["id"]]
    points = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=api.headers()).json()
    assert [p["step"] for p in points["points"]] == [1, 2]


def test_sqlite_dataset_quota_holds_for_parallel_uploads(sqlite_api: Api) -> None:
    """The owner's lock row on SQLite (its write lock): parallel uploads against room for
    two never pass it, and none fails for a locked database."""
    import threading

    from service.api.datasets.quota import prepared_bound

    api = sqlite_api
    size = 100_000
    room = 2 * prepared_bound("text", size) + 1000
    api.settings.dataset_max_owner_bytes = room
    start = threading.Barrier(6)
    codes: dict[str, int] = {}

    def one(i: int) -> None:
        start.wait()
        resp = api.client.post(
            "/v1/datasets", params={"name": f"s{i}"}, content=b"q" * size, headers=api.headers()
        )
        codes[f"s{i}"] = resp.status_code
        assert resp.status_code == 202 or "TRAINQ_DATASET_MAX_OWNER_BYTES" in resp.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(codes.values()) == [202, 202, 413, 413, 413, 413], codes
    listed = api.client.get("/v1/datasets", headers=api.headers()).json()["items"]
    assert sum(d["disk_bytes"] for d in listed) <= room


def test_sqlite_runs_room_holds_for_parallel_submits(sqlite_api: Api) -> None:
    """TRAINQ_RUNS_MAX_OWNER_BYTES on SQLite (the job_owners row's write lock): parallel
    submits against room for two never pass it, and none fails for a locked database."""
    import threading

    api = sqlite_api
    body = {"name": "r", "queue": api.queue, "train": {"steps": 5}}
    plan = api.client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=api.headers())
    each = plan.json()["disk"]["run_bytes"]
    api.settings.runs_max_owner_bytes = 2 * each + each // 2
    start = threading.Barrier(6)
    codes: list[int] = []

    def one() -> None:
        start.wait()
        resp = api.client.post("/v1/jobs", json=body, headers=api.headers())
        codes.append(resp.status_code)
        assert resp.status_code == 201 or "TRAINQ_RUNS_MAX_OWNER_BYTES" in resp.text

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(codes) == [201, 201, 422, 422, 422, 422], codes
