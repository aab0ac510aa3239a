"""Hostile tenants against the artifact endpoints: links planted in a run folder, one
owner's generations taking every worker thread, an upload that stalls to hold its slot."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.core.settings import Settings
from tests.api.support import Api, Uvicorn, make_tokens

pytestmark = pytest.mark.timeout(60)


@contextmanager
def _app(make_settings: Callable[..., Settings], **overrides: Any) -> Iterator[Any]:
    app = create_app(make_settings(**overrides))
    tokens = make_tokens(app.state.services)
    with TestClient(app) as client:
        yield app, client, {"Authorization": f"Bearer {tokens[1]}"}, tokens[2]


def _job_with_checkpoint(client: TestClient, headers: dict[str, str], settings: Settings,
                         queue: str) -> str:  # fmt: skip
    job = client.post(
        "/v1/jobs", json={"name": "t", "queue": queue, "train": {"steps": 5}}, headers=headers
    ).json()["id"]
    step = settings.runs_root / job / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "DONE").write_text("1\n")
    return str(job)


def _worker(app: Any, queue: str) -> None:
    services = app.state.services
    info = {"name": "w1", "host": "h1", "queues": [queue], "slots": 1, "gpus": [],
            "running": [], "ts": time.time()}  # fmt: skip
    services.redis.hset(services.keys.workers, "w1", json.dumps(info))


def test_generation_never_uses_a_checkpoint_that_is_a_link(
    api: Api, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    (outside / "step-9").mkdir(parents=True)
    (outside / "step-9" / "DONE").write_text("1\n")
    with _app(make_settings) as (app, client, headers, _):
        settings = app.state.services.settings
        job = _job_with_checkpoint(client, headers, settings, api.queue)
        ck = settings.runs_root / job / "checkpoints"
        (ck / "step-9").symlink_to(outside / "step-9")
        got = client.post(f"/v1/jobs/{job}/generate?step=9", json={"prompt": "a"},
                          headers=headers)  # fmt: skip
        assert got.status_code == 404 and "(it has 2)" in got.json()["detail"], got.text
        # The whole run folder a link to another run: no checkpoint at all.
        other = _job_with_checkpoint(client, headers, settings, api.queue)
        linked = _job_with_checkpoint(client, headers, settings, api.queue)
        (settings.runs_root / linked).rename(tmp_path / "moved")
        (settings.runs_root / linked).symlink_to(settings.runs_root / other)
        got = client.post("/v1/completions", json={"model": linked, "prompt": "a"},
                          headers=headers)  # fmt: skip
        assert got.status_code == 409 and "no complete checkpoint" in got.text, got.text


def _in_flight(app: Any) -> int:
    services = app.state.services
    keys = services.redis.keys(f"{services.settings.redis_prefix}:gen:inflight:*")
    return sum(int(services.redis.zcard(k)) for k in keys)


def test_generations_in_flight_per_owner_are_bounded_across_replicas(
    api: Api, make_settings: Callable[..., Settings]
) -> None:
    # Two API replicas (two apps sharing the store and Redis), a limit of 2. No worker
    # consumes the queue: each request waits out its deadline (0.3 s + grace), then 504.
    with _app(make_settings, generate_max_per_owner=2, generate_timeout_s=0.3) as (
        app,
        client,
        headers,
        _,
    ):
        replica = create_app(app.state.services.settings)
        with TestClient(replica) as client2:
            # FastAPI builds an app's route table on its first request, from route objects
            # every app of the process shares: the replica answers one before the threads
            # start (tests/api/support.through_two_replicas; two at once raised a 500 in CI).
            client2.get("/v1/no-such-route")
            job = _job_with_checkpoint(client, headers, app.state.services.settings, api.queue)
            _worker(app, api.queue)
            body = {"model": job, "prompt": "a", "stream": True}
            answers: list[httpx.Response] = []
            holders = [
                threading.Thread(
                    target=lambda c=c: answers.append(
                        c.post("/v1/completions", json=body, headers=headers)
                    )
                )
                for c in (client, client2)
            ]
            for t in holders:
                t.start()
            deadline = time.time() + 10
            while _in_flight(app) < 2 and time.time() < deadline:
                time.sleep(0.01)
            assert _in_flight(app) == 2, "one slot on each replica, counted in Redis"
            # Each replica alone holds one: an in-process count would let this through.
            third = client2.post("/v1/completions", json=body, headers=headers)
            assert third.status_code == 429, third.text
            assert "TRAINQ_GENERATE_MAX_PER_OWNER" in third.json()["error"]["message"]
            assert third.json()["error"]["code"] == "rate_limit_exceeded"
            assert "Retry-After" in third.headers
            for t in holders:
                t.join()
            assert [r.status_code for r in answers] == [504, 504], [r.text for r in answers]
            assert _in_flight(app) == 0  # released when they ended (a 504 too)
            again = client.post(f"/v1/jobs/{job}/generate", json={"prompt": "a"},
                                headers=headers)  # fmt: skip
            assert again.status_code == 504, again.text
            assert _in_flight(app) == 0


def test_a_stalled_upload_is_cut_with_408_and_leaves_nothing(
    make_settings: Callable[..., Settings],
) -> None:
    app = create_app(make_settings(dataset_upload_idle_s=0.5))
    token = make_tokens(app.state.services)[1]
    with Uvicorn(app) as server:
        url = urlsplit(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            head = (
                "POST /v1/datasets?name=slow HTTP/1.1\r\n"
                f"Host: {url.hostname}\r\nAuthorization: Bearer {token}\r\n"
                "Transfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n"
                "5\r\nhello\r\n"  # one chunk, then nothing: no Content-Length, no end
            )
            sock.sendall(head.encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                got = sock.recv(4096)
                assert got, answer
                answer += got
        assert answer.startswith(b"HTTP/1.1 408"), answer
        listed = httpx.get(
            f"{server.url}/v1/datasets", headers={"Authorization": f"Bearer {token}"}
        ).json()
        assert [d["name"] for d in listed["items"]] == []
