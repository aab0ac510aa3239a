"""Chaos: the stores fail under queued and running jobs, and every job that the API
acknowledged (a 201) still ends in a true terminal state.

A private ``redis-server`` without persistence (``--save "" --appendonly no``) is killed
with SIGKILL and started again empty while one job trains and others wait in the broker:
their messages, the heartbeats, claims, registry and the events stream's consumer group are
all gone at once. The store is the truth: the reconciler finds the sent attempts whose
message is in no broker queue and sends them again, the ingestor makes its group again,
the worker re-registers and its run keeps reporting.

A private PostgreSQL is not started here: the API's PostgreSQL outages (connections
refused, then back) are covered by tests/api/test_outage.py against the shared server.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.local.embedded import redis_binary
from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import System, build_system, free_port, wait_for
from tests.e2e.test_system import TRAIN as SYSTEM_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUEUE = "chaos"
# test_system's tiny run, one layer smaller: four of them train one after another here.
TRAIN: dict[str, Any] = {
    **SYSTEM_TRAIN,
    "seed": 3,
    "model": {**SYSTEM_TRAIN["model"], "n_layer": 1},
}
TERMINAL = ("succeeded", "failed", "cancelled")


class PrivateRedis:
    """A redis-server of this test alone, with no persistence at all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.folder), "--save", "", "--appendonly", "no",
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(up, 20, "the private redis-server to answer")
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.kill()


@pytest.fixture
def chaos_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path: Path,
    redis_server: PrivateRedis,
) -> Iterator[System]:
    settings = {
        **FAST_SETTINGS,
        "TRAINQ_ORPHAN_CHECK_S": "1",
        "TRAINQ_UNSENT_GRACE_S": "1",
    }
    urls = (f"{redis_server.url}/0", f"{redis_server.url}/1")
    system = build_system(tmp_path / "sys", pg_url, redis_dbs, subprocess_env, settings, urls)
    yield system
    system.stop()


def test_redis_restarted_empty_loses_no_acknowledged_job(
    chaos_system: System, redis_server: PrivateRedis
) -> None:
    api = chaos_system.start_api(auth=False)
    chaos_system.start_worker(QUEUE, name="chaos-w1")

    def submit(name: str, steps: int, retries: int) -> str:
        body = {
            "name": name,
            "queue": QUEUE,
            "retries": retries,
            "train": {**TRAIN, "steps": steps},
        }
        with api.client() as client:
            r = client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def job(job_id: str) -> dict[str, Any]:
        with api.client() as client:
            return dict(client.get(f"/v1/jobs/{job_id}").json())

    running = submit("chaos-running", 200, retries=2)

    def trains() -> bool:
        with api.client() as client:
            r = client.get(f"/v1/jobs/{running}/metrics")
        return r.status_code == 200 and r.json()["total"] >= 3

    wait_for(trains, 90, "the first job to train", every=0.2)
    queued = [submit(f"chaos-queued-{n}", 5, retries=1) for n in range(3)]
    assert all(job(j)["status"] == "queued" for j in queued)

    redis_server.kill()  # everything in Redis is gone: messages, keys, streams, groups
    with api.client() as client:  # the API keeps answering from the store meanwhile
        assert client.get(f"/v1/jobs/{queued[0]}").status_code in (200, 503)
    redis_server.start()
    with api.client() as client:
        first = client.get(f"/v1/jobs/{queued[0]}").json()
    assert first["status"] in ("queued", "running", "succeeded"), first
    if first["status"] == "queued":
        assert first["pending_reason"], first  # never null: it always says why it waits

    def settled() -> list[dict[str, Any]] | None:
        jobs = [job(j) for j in (running, *queued)]
        return jobs if all(j["status"] in TERMINAL for j in jobs) else None

    try:
        jobs = wait_for(settled, 200, "every acknowledged job to end", every=0.5)
    except TimeoutError:
        tails = "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in chaos_system.procs)
        states = [(j, job(j)["status"], job(j)["pending_reason"]) for j in (running, *queued)]
        raise AssertionError(f"{states}\n{tails}") from None
    assert [j["status"] for j in jobs] == ["succeeded"] * 4, jobs
    assert jobs[0]["latest"]["step"] == 200
    with httpx.Client(base_url=api.url, timeout=10) as client:
        assert client.get("/readyz").status_code == 200
