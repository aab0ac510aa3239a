"""Per-owner submit limits (service.api.scheduling.ratelimit): submits per window, queued jobs; 429
with Retry-After naming the setting; idempotent replays neither counted nor refused; the CLI's
``submit --wait`` retries a 429 after its Retry-After."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from service.api.app import create_app
from service.api.core.settings import Settings
from service.cli import main as cli
from tests.api.support import Uvicorn, WorkerSim, closed_url, forget_jobs_since, make_tokens

MakeSettings = Callable[..., Settings]


@contextmanager
def limited(make_settings: MakeSettings, **overrides: Any) -> Iterator[tuple[Any, str, str]]:
    """An app with these settings: (its TestClient, a token, another owner's token)."""
    started_ms = int(time.time() * 1000)
    app = create_app(make_settings(**overrides))
    _, token, other, _ = make_tokens(app.state.services)
    try:
        with TestClient(app) as client:
            yield client, token, other
    finally:
        forget_jobs_since(app.state.services.settings.database_url, started_ms)


def _submit(client: Any, token: str, key: str | None = None, steps: int = 5) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    body = {"name": "t", "queue": f"q{uuid.uuid4().hex[:8]}", "train": {"steps": steps}}
    if key is not None:
        body["queue"] = "qlimits"  # a replay sends the same spec
    return client.post("/v1/jobs", json=body, headers=headers)


def test_submits_per_window_429_with_retry_after(make_settings: MakeSettings) -> None:
    with limited(make_settings, submits_per_minute=3) as (client, token, other):
        first = _submit(client, token, key="k1")
        assert first.status_code == 201, first.text
        assert [_submit(client, token).status_code for _ in range(2)] == [201, 201]
        refused = _submit(client, token)
        assert refused.status_code == 429, refused.text
        # The previous window weighs on the next one: the wait is under two windows.
        assert 1 <= int(refused.headers["Retry-After"]) <= 121
        detail = refused.json()["detail"]
        assert "TRAINQ_SUBMITS_PER_MINUTE=3" in detail and "3 submits per 60 s" in detail
        assert _submit(client, token).status_code == 429  # a refusal is not counted, still 429
        # A replay of the key creates nothing: neither counted nor refused.
        replay = _submit(client, token, key="k1")
        assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
        # The same key with another spec is still the key's conflict, not the limit.
        assert _submit(client, token, key="k1", steps=6).status_code == 409
        # A new key is a new submit: refused.
        assert _submit(client, token, key="k2").status_code == 429
        # Another owner has a window of its own.
        assert _submit(client, other).status_code == 201


def test_queued_jobs_per_owner(make_settings: MakeSettings) -> None:
    with limited(make_settings, max_queued_per_owner=2, submits_per_minute=0) as (
        client,
        token,
        other,
    ):
        jobs = [_submit(client, token) for _ in range(2)]
        assert [r.status_code for r in jobs] == [201, 201]
        refused = _submit(client, token)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "30"
        assert "TRAINQ_MAX_QUEUED_PER_OWNER=2" in refused.json()["detail"]
        assert _submit(client, other).status_code == 201
        headers = {"Authorization": f"Bearer {token}"}
        cancel = client.post(f"/v1/jobs/{jobs[0].json()['id']}/cancel", headers=headers)
        assert cancel.json()["status"] == "cancelled"
        assert _submit(client, token).status_code == 201  # one fewer queued: room again


def test_with_redis_down_submits_are_stored_and_not_rate_limited(
    make_settings: MakeSettings,
) -> None:
    """A submit needs only SQL: a rate limiter must not turn a Redis outage into refusals."""
    down = {"redis_url": closed_url("redis"), "submits_per_minute": 3}
    with limited(make_settings, **down) as (client, token, _):
        codes = [_submit(client, token).status_code for _ in range(5)]
        assert codes == [201] * 5  # past the limit of 3: not applied while Redis is away


def test_cli_submit_wait_retries_a_429(make_settings: MakeSettings, tmp_path: Path) -> None:
    started_ms = int(time.time() * 1000)
    settings = make_settings(submits_per_minute=1, submit_window_s=1.0, ingest=True)
    app = create_app(settings)
    services = app.state.services
    _, token, _, _ = make_tokens(services)
    queue = f"q{uuid.uuid4().hex[:8]}"
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "cli", "queue": queue, "train": {"steps": 5}}))
    headers = {"Authorization": f"Bearer {token}"}
    done = threading.Event()

    def worker(url: str) -> None:
        """Runs the CLI's job to success once it is submitted (what a worker would send)."""
        with httpx.Client(base_url=url, headers=headers) as http:
            while not done.is_set():
                items = http.get("/v1/jobs", params={"name": "cli"}).json()["items"]
                if items:
                    sim = WorkerSim(services.redis, services.keys, items[0]["id"])
                    sim.claim()
                    sim.running()
                    sim.exited(0)
                    return
                time.sleep(0.1)

    try:
        with Uvicorn(app) as server:
            first = httpx.post(
                f"{server.url}/v1/jobs",
                json={"name": "first", "queue": queue, "train": {"steps": 5}},
                headers=headers,
            )
            assert first.status_code == 201, first.text  # the window's one submit
            thread = threading.Thread(target=worker, args=(server.url,), daemon=True)
            thread.start()
            env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": token}
            result = CliRunner().invoke(
                cli.app,
                ["submit", str(spec), "--wait", "--timeout", "60"],
                env=env,
                catch_exceptions=False,
            )
            done.set()
            thread.join(10)
        assert result.exit_code == 0, result.stderr
        refusals = [line for line in result.stderr.splitlines() if "submit refused" in line]
        assert refusals, result.stderr
        assert "TRAINQ_SUBMITS_PER_MINUTE=1" in refusals[0] and "retrying in" in refusals[0]
        assert "submitted" in result.stdout
    finally:
        done.set()
        forget_jobs_since(settings.database_url, started_ms)


def test_cli_submit_429_without_wait_is_one_line(
    make_settings: MakeSettings, tmp_path: Path
) -> None:
    started_ms = int(time.time() * 1000)
    settings = make_settings(submits_per_minute=1)
    app = create_app(settings)
    _, token, _, _ = make_tokens(app.state.services)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "cli", "queue": "qlimits", "train": {"steps": 5}}))
    try:
        with Uvicorn(app) as server:
            env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": token}
            runs = [CliRunner().invoke(cli.app, ["submit", str(spec)], env=env) for _ in "ab"]
    finally:
        forget_jobs_since(settings.database_url, started_ms)
    assert runs[0].exit_code == 0, runs[0].stderr
    assert runs[1].exit_code == 6, runs[1].stderr
    line = runs[1].stderr.strip()
    assert "\n" not in line and line.startswith("trainq: error: too many requests (429)")
    assert "TRAINQ_SUBMITS_PER_MINUTE=1" in line and "retry after" in line
