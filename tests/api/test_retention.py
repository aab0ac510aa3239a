"""Retention (service.api.scheduling.retention): ``DELETE /v1/jobs/{id}`` and the background pass
delete finished jobs with their attempts, metrics, logs, Redis stream and (when asked) run folder,
never a job that is still queued or running, never anything a link in the runs root points at;
``trainq rm`` answers in one line."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select, update
from typer.testing import CliRunner

from service.api.app import create_app
from service.api.core import migrate
from service.api.core.models import ATTEMPTS, JOBS, LOGS, METRICS, utcnow
from service.api.core.settings import Settings
from service.api.scheduling.retention import Retention, delete_jobs
from service.cli import main as cli
from tests.api.support import Api, Uvicorn, WorkerSim, forget_jobs_since, make_tokens

MakeSettings = Callable[..., Settings]


@pytest.fixture()
def api(make_settings: MakeSettings) -> Iterator[Api]:
    """The conftest's ``api``, with retention on (a day) and run folders removed."""
    started_ms = int(time.time() * 1000)
    settings = make_settings(retention_days=1, retention_remove_runs=True)
    app = create_app(settings)
    user, token, other, admin = make_tokens(app.state.services)
    with TestClient(app) as client:
        yield Api(app, client, app.state.services, user, token, other, admin)
    forget_jobs_since(settings.database_url, started_ms)


@pytest.fixture()
def sqlite_api(make_settings: MakeSettings, tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'embedded' / 'trainq.db'}"
    migrate.upgrade(url)
    app = create_app(make_settings(database_url=url, retention_remove_runs=True))
    user, token, other, admin = make_tokens(app.state.services)
    with TestClient(app) as client:
        yield Api(app, client, app.state.services, user, token, other, admin)


def _rows(api: Api, job_id: str) -> dict[str, int]:
    """How many rows the job has in each table."""
    with api.services.sessions() as session:
        return {
            t.name: int(
                session.execute(
                    select(func.count())
                    .select_from(t)
                    .where((t.c.id if t is JOBS else t.c.job_id) == job_id)
                ).scalar_one()
            )
            for t in (JOBS, ATTEMPTS, METRICS, LOGS)
        }


def _succeeded(api: Api) -> str:
    """A job driven to succeeded through real events and the ingestor, with a run folder."""
    job_id = str(api.submit()["id"])
    w = WorkerSim(api.services.redis, api.keys, job_id)
    w.running()
    w.metric(1)
    w.metric(2)
    w.log((0, "hello"))
    w.exited(0)
    api.drain()
    assert api.get(job_id)["status"] == "succeeded"
    run = api.settings.runs_root / job_id
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    return job_id


def _delete(api: Api, job_id: str, token: str | None = None) -> Any:
    return api.client.delete(f"/v1/jobs/{job_id}", headers=api.headers(token))


def test_delete_running_is_409_and_a_finished_job_goes_with_all_it_had(
    api: Api, tmp_path: Path
) -> None:
    running = str(api.submit()["id"])
    w = WorkerSim(api.services.redis, api.keys, running)
    w.running()
    w.metric(1)
    api.drain()
    before = _rows(api, running)
    refused = _delete(api, running)
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"] == f"job {running} is running; cancel it first"
    assert _rows(api, running) == before and before["metrics"] == 1

    done = _succeeded(api)
    assert _rows(api, done) == {"jobs": 1, "attempts": 1, "metrics": 2, "logs": 1}
    assert api.services.redis.exists(api.keys.job(done))
    run = api.settings.runs_root / done
    # A link inside the run folder: removed, never followed.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    (run / "escape").symlink_to(outside)

    assert _delete(api, done, api.other_token).status_code == 404  # not theirs: as GET answers
    assert _rows(api, done)["jobs"] == 1
    gone = _delete(api, done)
    assert gone.status_code == 204 and gone.content == b""
    assert _rows(api, done) == {"jobs": 0, "attempts": 0, "metrics": 0, "logs": 0}
    assert not run.exists() and (outside / "keep.txt").exists()
    assert not api.services.redis.exists(api.keys.job(done))
    assert api.client.get(f"/v1/jobs/{done}", headers=api.headers()).status_code == 404
    assert _delete(api, done).status_code == 404

    # An admin may delete anyone's; a cancelled job is finished too. Its run folder is a link
    # out of the runs root: the link goes, what it points at stays.
    cancelled = str(api.submit()["id"])
    assert api.client.post(f"/v1/jobs/{cancelled}/cancel", headers=api.headers()).status_code == 200
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    api.settings.runs_root.mkdir(exist_ok=True)
    (api.settings.runs_root / cancelled).symlink_to(target)
    assert _delete(api, cancelled, api.admin_token).status_code == 204
    assert not (api.settings.runs_root / cancelled).is_symlink()
    assert (target / "keep.txt").exists()
    assert _rows(api, running) == before  # untouched throughout


def test_retention_pass_deletes_only_finished_jobs_past_the_cutoff(api: Api) -> None:
    old, recent = _succeeded(api), _succeeded(api)
    queued = str(api.submit()["id"])
    long_ago = utcnow() - timedelta(days=3)
    with api.services.sessions() as session, session.begin():
        # The queued job's ended_at is set too: its status alone must keep it.
        session.execute(update(JOBS).where(JOBS.c.id.in_([old, queued])).values(ended_at=long_ago))
    retention = Retention(api.settings, api.services.sessions, api.services.redis)
    # Another replica holds the pass: this one does nothing.
    api.services.redis.set(retention.lock_key, "someone-else", px=10_000)
    assert retention.run_once() == 0 and _rows(api, old)["jobs"] == 1
    api.services.redis.delete(retention.lock_key)

    assert retention.run_once() >= 1  # the shared store may hold other old finished jobs
    assert _rows(api, old) == {"jobs": 0, "attempts": 0, "metrics": 0, "logs": 0}
    assert not (api.settings.runs_root / old).exists()
    assert _rows(api, recent)["metrics"] == 2 and (api.settings.runs_root / recent).exists()
    assert _rows(api, queued)["jobs"] == 1 and api.get(queued)["status"] == "queued"
    assert not api.services.redis.exists(retention.lock_key)  # released by its holder

    off = Retention(
        api.settings.model_copy(update={"retention_days": 0}),
        api.services.sessions,
        api.services.redis,
    )
    with api.services.sessions() as session, session.begin():
        session.execute(update(JOBS).where(JOBS.c.id == recent).values(ended_at=long_ago))
    assert off.run_once() == 0 and _rows(api, recent)["jobs"] == 1  # 0 days: kept forever


def test_sqlite_delete_with_and_without_the_foreign_keys_pragma(sqlite_api: Api) -> None:
    api = sqlite_api
    first, second = _succeeded(api), _succeeded(api)
    assert _delete(api, first).status_code == 204
    assert _rows(api, first) == {"jobs": 0, "attempts": 0, "metrics": 0, "logs": 0}
    assert not (api.settings.runs_root / first).exists()
    # An engine made without service.api.core.db's pragmas (foreign keys off): the children are
    # deleted explicitly all the same, so none is left behind.
    plain = create_engine(api.settings.database_url)
    try:
        assert delete_jobs(plain, [second, "not-hex/.."], api.settings.runs_root, False) == 1
    finally:
        plain.dispose()
    assert _rows(api, second) == {"jobs": 0, "attempts": 0, "metrics": 0, "logs": 0}
    assert (api.settings.runs_root / second).exists()  # remove_runs off: the folder stays


def test_trainq_rm_one_line_answers(make_settings: MakeSettings) -> None:
    started_ms = int(time.time() * 1000)
    app = create_app(make_settings())
    _, token, _, _ = make_tokens(app.state.services)
    headers = {"Authorization": f"Bearer {token}"}
    body = {"name": "t", "queue": "qretention", "train": {"steps": 5}}
    try:
        with Uvicorn(app) as server:
            env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": token}

            def trainq(*args: str) -> tuple[int, str, str]:
                r = CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)
                return r.exit_code, r.stdout, r.stderr

            with httpx.Client(base_url=server.url, headers=headers) as http:
                queued = http.post("/v1/jobs", json=body).json()["id"]
                finished = http.post("/v1/jobs", json=body).json()["id"]
                assert http.post(f"/v1/jobs/{finished}/cancel").json()["status"] == "cancelled"

            code, _, err = trainq("rm", queued)
            assert code == 6 and "\n" not in err.strip()
            assert err.strip() == (
                f"trainq: error: conflict (409): job {queued} is queued; cancel it first"
            )
            assert trainq("rm", finished) == (0, f"job {finished} deleted\n", "")
            code, _, err = trainq("rm", finished)
            assert code == 6 and "\n" not in err.strip() and "not found" in err
    finally:
        forget_jobs_since(app.state.services.settings.database_url, started_ms)
