"""Redis or the database away: 503 with a clear message, never a 500; back when they are.

The database outage goes through a small TCP relay in front of the real PostgreSQL that the
test can cut and restore: a fake only at the network edge, because stopping the shared
PostgreSQL server would break every other test session on the machine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from service.api.app import create_app
from tests.api.support import Api, closed_url, make_tokens


class Relay:
    """Forwards 127.0.0.1:port to a target; ``cut()`` drops every connection and refuses new
    ones until ``restore()``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.open = False
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        self.stopped = True
        self.cut()
        self.listener.close()


@pytest.fixture()
def relay(pg_migrated: str) -> Iterator[tuple[Relay, str]]:
    url = make_url(pg_migrated)
    r = Relay(url.host or "127.0.0.1", url.port or 5432)
    yield r, url.set(host="127.0.0.1", port=r.port).render_as_string(hide_password=False)
    r.close()


def _no_500(resp: Any) -> None:
    assert resp.status_code < 500 or resp.status_code == 503, resp.text
    assert "Traceback" not in resp.text


def test_redis_unreachable_is_503(api: Api, make_settings: Callable[..., Any]) -> None:
    job = api.submit()
    app = create_app(make_settings(redis_url=closed_url("redis"), token_cache_s=0))
    admin = make_tokens(app.state.services)[3]
    h = api.headers()
    with TestClient(app) as client:
        cancel = client.post(f"/v1/jobs/{job['id']}/cancel", headers=h)
        assert cancel.status_code == 503 and "Redis is unavailable" in cancel.json()["detail"]
        assert client.get("/v1/workers", headers=h).status_code == 503
        assert client.get(f"/v1/jobs/{job['id']}/events", headers=h).status_code == 503
        follow = client.get(f"/v1/jobs/{job['id']}/logs", params={"follow": True}, headers=h)
        assert follow.status_code == 503
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["redis"].startswith("unavailable")
        assert ready.json()["database"] == "ok"
        # What needs only SQL still answers: the job, the list.
        got = client.get(f"/v1/jobs/{job['id']}", headers=h)
        assert got.status_code == 200
        # The job is answered, and says why it waits even without the registry.
        assert got.json()["pending_reason"] == (
            f"waiting in queue {api.queue}; the worker registry is unreachable right now"
        )
        assert client.get("/v1/jobs", headers=h).status_code == 200
        assert client.get("/metrics", headers=api.headers(admin)).status_code == 200
    assert api.get(job["id"])["status"] == "queued"  # the failed cancel changed nothing


def test_database_outage_is_503_and_recovers(
    api: Api, relay: tuple[Relay, str], make_settings: Callable[..., Any]
) -> None:
    proxy, url = relay
    app = create_app(make_settings(database_url=url, token_cache_s=0, db_timeout_s=1))
    h = api.headers()
    with TestClient(app) as client:
        job = client.post("/v1/jobs", json={"queue": api.queue, "train": {}}, headers=h)
        assert job.status_code == 201
        job_id = job.json()["id"]
        proxy.cut()
        calls: list[tuple[str, str, dict[str, Any]]] = [
            ("GET", f"/v1/jobs/{job_id}", {}),
            ("GET", "/v1/jobs", {}),
            ("POST", "/v1/jobs", {"json": {"train": {}}}),
            ("POST", f"/v1/jobs/{job_id}/cancel", {}),
            ("GET", f"/v1/jobs/{job_id}/metrics", {}),
        ]
        for method, path, kw in calls:
            resp = client.request(method, path, headers=h, **kw)
            _no_500(resp)
            assert resp.status_code == 503, (path, resp.text)
            assert resp.json() == {"detail": "the database is unavailable; try again shortly"}
        assert client.get("/readyz").status_code == 503
        proxy.restore()
        back = client.get(f"/v1/jobs/{job_id}", headers=h)
        assert back.status_code == 200 and back.json()["id"] == job_id
        assert client.get("/readyz").status_code == 200

        # A restart nobody saw: pooled connections are dead, yet no request fails after it.
        for _ in range(3):
            client.get(f"/v1/jobs/{job_id}", headers=h)  # fill the pool with live ones
        proxy.cut()
        proxy.restore()
        time.sleep(0.05)  # the closed sockets' EOF reaches this side
        for path in (f"/v1/jobs/{job_id}", "/v1/jobs", f"/v1/jobs/{job_id}/metrics"):
            resp = client.get(path, headers=h)
            assert resp.status_code == 200, (path, resp.text)
