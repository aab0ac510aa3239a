"""Helpers of the service tests: the app under test, and a worker's side of the wire.

``WorkerSim`` produces events into Redis exactly as a worker and trainer rank 0 do (the same
``Event.to_fields``, the same two streams, the same heartbeat and claim keys), so the
ingestor and the reconciler see what they would see in production.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis as redis_lib
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.core.auth import create_token
from service.api.core.deps import Services
from service.api.core.settings import Settings
from service.api.scheduling.reconcile import Reconciler
from service.api.streams.ingest import Ingestor
from trainer.events import Event, Keys
from worker.message import broker_queue

__all__ = [
    "Api",
    "Uvicorn",
    "WorkerSim",
    "closed_url",
    "forget_jobs_since",
    "free_port",
    "make_tokens",
    "register_worker",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_url(scheme: str) -> str:
    """A URL on a loopback port nothing listens on (bound, then released)."""
    return f"{scheme}://127.0.0.1:{free_port()}/0"


@dataclass
class Api:
    app: FastAPI
    client: TestClient
    services: Services
    user: str  # owner name of `token`
    token: str
    other_token: str
    admin_token: str
    queue: str = field(default_factory=lambda: f"q{uuid.uuid4().hex[:8]}")

    @property
    def settings(self) -> Settings:
        return self.services.settings

    @property
    def keys(self) -> Keys:
        return self.services.keys

    @property
    def broker_queue(self) -> str:
        """The broker list that holds this test's queue's messages."""
        return broker_queue(self.queue, self.settings.redis_prefix)

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def submit(self, **spec: Any) -> dict[str, Any]:
        body = {"name": "t", "queue": self.queue, "train": {"steps": 5}, **spec}
        resp = self.client.post("/v1/jobs", json=body, headers=self.headers())
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    def get(self, job_id: str) -> dict[str, Any]:
        resp = self.client.get(f"/v1/jobs/{job_id}", headers=self.headers())
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def ingestor(self, consumer: str | None = None) -> Ingestor:
        s = self.services
        return Ingestor(s.settings, s.sessions, s.redis, s.dispatcher, consumer=consumer)

    def reconciler(self) -> Reconciler:
        s = self.services
        return Reconciler(s.settings, s.sessions, s.redis, s.dispatcher)

    def drain(self, ingestor: Ingestor | None = None, rounds: int = 20) -> int:
        """Ingest until the stream has nothing new (bounded)."""
        ing = ingestor or self.ingestor()
        total = 0
        for _ in range(rounds):
            n = ing.run_once(block_ms=None)
            if n == 0:
                break
            total += n
        return total


def through_two_replicas(api: Api, n: int, call: Callable[[TestClient], int]) -> list[int]:
    """``call`` made by ``n`` threads released together, half of them through the test's app
    and half through a second API replica (same store and Redis); their answers' statuses."""
    from service.api.app import create_app

    answers: list[int] = []
    start = threading.Barrier(n)

    def one(client: TestClient) -> None:
        start.wait(timeout=30)
        answers.append(call(client))

    with TestClient(create_app(api.services.settings)) as other:
        # FastAPI builds an app's route table on its first request, from route objects that
        # every app of this process shares. Under uvicorn one event loop does that, once;
        # two apps matching their first requests from many threads build those shared
        # routes at once (FastAPI 0.165 raised pydantic warnings from there, a 500). One
        # request each first, as the process's first request would be.
        for client in (api.client, other):
            client.get("/v1/no-such-route")
        threads = [
            threading.Thread(target=one, args=(api.client if i % 2 else other,)) for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    return answers


def make_tokens(services: Services) -> tuple[str, str, str, str]:
    user = f"alice-{uuid.uuid4().hex[:6]}"
    with services.sessions() as session, session.begin():
        token = create_token(session, user)
        other = create_token(session, f"bob-{uuid.uuid4().hex[:6]}")
        admin = create_token(session, f"root-{uuid.uuid4().hex[:6]}", admin=True)
    return user, token, other, admin


def forget_jobs_since(url: str, started_ms: int) -> None:
    """Delete the jobs a test created (ids start with their creation time in ms): the
    reconciler scans every attempt in the store, and this store is shared by the session."""
    from sqlalchemy import create_engine, delete, pool

    from service.api.core.models import JOBS

    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(delete(JOBS).where(JOBS.c.id >= f"{started_ms:012x}"))
    finally:
        engine.dispose()


class WorkerSim:
    """Produces what a worker and trainer rank 0 put on the wire for one attempt: the same
    fields (Event.to_fields), the same two streams, the heartbeat and claim keys."""

    def __init__(self, r: redis_lib.Redis, keys: Keys, job_id: str, attempt: int = 1) -> None:
        self.r = r
        self.keys = keys
        self.job_id = job_id
        self.attempt = attempt
        self.seq = {"worker": 0, "trainer": 0}

    def event(self, kind: str, source: str, data: dict[str, Any]) -> Event:
        self.seq[source] += 1
        ev = Event(kind, self.job_id, self.attempt, source, self.seq[source], data)  # type: ignore[arg-type]
        self.send(ev)
        return ev

    def send(self, ev: Event) -> None:
        pipe = self.r.pipeline(transaction=True)
        fields: Any = ev.to_fields()
        pipe.xadd(self.keys.events, fields, maxlen=1_000_000, approximate=True)
        pipe.xadd(self.keys.job(ev.job_id), fields, maxlen=10_000, approximate=True)
        pipe.execute()

    def claim(self, ttl: int = 10) -> None:
        self.r.set(self.keys.claim(self.job_id, self.attempt), "w1", nx=True, ex=7 * 86400)
        self.r.set(self.keys.heartbeat(self.job_id, self.attempt), "1", ex=ttl)

    node = 0  # NodeSim: node n of a multi-node attempt

    def stop_heartbeat(self) -> None:
        self.r.delete(self.keys.heartbeat(self.job_id, self.attempt))

    def hand_over(self, ttl_ms: int = 60_000) -> None:
        """What a worker does once its exit event is sent: the "exited" marker replaces the
        heartbeat in one transaction (worker.watchers.Heartbeat.hand_over)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.keys.exited(self.job_id, self.attempt, self.node), "w1", px=ttl_ms)
        pipe.delete(self.keys.heartbeat(self.job_id, self.attempt, self.node))
        pipe.execute()

    def running(self) -> Event:
        return self.event(
            "lifecycle", "worker", {"phase": "running", "host": "h1", "worker": "w1", "pid": 4242}
        )

    def metric(self, step: int, steps: int = 5, **extra: Any) -> Event:
        data = {
            "step": step,
            "steps": steps,
            "time": step * 0.1,
            "loss": 5.0 - step * 0.1,
            "lr": 3e-4,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "tokens_per_s_per_device": 500.0,
            "step_time_s": 0.1,
            "tflops": None,
            "mfu": None,
            "mem_peak_bytes": 1e6,
            "data_wait_frac": 0.01,
            **extra,
        }
        return self.event("metric", "trainer", data)

    def log(self, *lines: tuple[int | None, str]) -> Event:
        return self.event(
            "log",
            "worker",
            {"lines": [{"rank": r, "stream": "stdout", "line": text} for r, text in lines]},
        )

    def exited(
        self, exit_code: int | None = 0, reason: str | None = None, message: str = ""
    ) -> Event:
        return self.event(
            "lifecycle",
            "worker",
            {"phase": "exited", "exit_code": exit_code, "reason": reason, "message": message},
        )


def register_worker(
    api: Api,
    queues: list[str],
    name: str = "w1",
    age_s: float = 0,
    running: list[str] | None = None,
) -> None:
    info = {
        "name": name,
        "host": "h1",
        "queues": queues,
        "slots": 2,
        "gpus": [0, 1],
        "running": running or [],
        "ts": time.time() - age_s,
    }
    api.services.redis.hset(api.keys.workers, name, json.dumps(info))


class Uvicorn:
    """The app served by a real uvicorn on a free port, in a thread of this process."""

    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Uvicorn:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
