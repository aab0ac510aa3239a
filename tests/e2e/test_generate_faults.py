"""Generation under faults (issue 22): a streamed completion ends with the documented error
event, never a silent stop or a two-minute wait, when the worker generating it is killed or
when Redis goes away mid-stream; extreme but valid sampling parameters get an answer.

One system of this module alone on a private ``redis-server`` (tests/e2e/test_chaos.py's),
so killing it disturbs nobody; the shared Redis is never touched. A tiny model with a long
context is trained once, so that one streamed request of 16 sequences runs for seconds and
can be cut in the middle. Each fault test starts its own worker (killing one must not take
the next test's with it); the Redis test comes last, as it ends this system.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import Api, System, build_system, wait_for
from tests.e2e.test_chaos import PrivateRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUEUE = "genfault"
SEQ_LEN = 2048
STALE_S = 3  # the API's TRAINQ_WORKER_STALE_S here (the worker beats every 1 s)
TRAIN: dict[str, Any] = {
    "steps": 2,
    "seed": 5,
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": SEQ_LEN, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 1},
    "optim": {"lr": 1e-2, "warmup_steps": 1},
    "eval": {"every": 0},
    "checkpoint": {"every": 2, "keep": 1},
    "log_every": 1,
}
# 16 sequences of up to ~2000 tokens: seconds of deltas, time enough to cut the stream.
LONG = {"prompt": "Once upon a ", "max_tokens": SEQ_LEN - 64, "n": 16, "temperature": 1.0,
        "seed": 1, "stream": True}  # fmt: skip


class Faults:
    def __init__(self, system: System, redis: PrivateRedis, api: Api, job_id: str) -> None:
        self.system, self.redis, self.api, self.job_id = system, redis, api, job_id


@pytest.fixture(scope="module")
def faults(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Faults]:
    root = tmp_path_factory.mktemp("genfault")
    redis = PrivateRedis(root)
    redis.start()
    urls = (f"{redis.url}/0", f"{redis.url}/1")
    settings = {**FAST_SETTINGS, "TRAINQ_WORKER_STALE_S": str(STALE_S)}
    system = build_system(root / "sys", pg_url, redis_dbs, subprocess_env, settings, urls)
    try:
        api = system.start_api(auth=False)
        trainer = system.start_worker(QUEUE, name="genfault-trainer")
        body = {"name": "long-context", "queue": QUEUE, "procs_per_node": 1, "train": TRAIN}
        with api.client() as c:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job_id = str(r.json()["id"])

            def done() -> bool:
                status = c.get(f"/v1/jobs/{job_id}").json()["status"]
                assert status in ("queued", "running", "succeeded"), status
                return status == "succeeded"

            wait_for(done, 180, "the long-context training run", every=0.3)
        trainer.stop()  # each test starts the worker it needs
        yield Faults(system, redis, api, job_id)
    finally:
        system.stop()
        if redis.proc is not None and redis.proc.poll() is None:
            redis.kill()


def stream_until_cut(f: Faults, cut: Any) -> tuple[int, list[Any], float]:
    """Stream LONG; after the first delta call ``cut()``; return the status, every data
    payload and the seconds from the cut to the stream's end. The read timeout (60 s) is
    well under the generation deadline (120 s) and its grace: a relay that waits for the
    deadline fails here rather than passing late."""
    events: list[Any] = []
    cut_at = 0.0
    timeout = httpx.Timeout(10, read=60)
    with (
        f.api.client() as c,
        c.stream("POST", "/v1/completions", json={"model": f.job_id, **LONG},
                 timeout=timeout) as r,
    ):  # fmt: skip
        status = r.status_code
        if status != 200:
            r.read()
            return status, [r.text], 0.0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if not cut_at and isinstance(events[-1], dict) and events[-1].get("choices"):
                cut()
                cut_at = time.monotonic()
    return status, events, time.monotonic() - cut_at if cut_at else 0.0


def test_a_worker_killed_mid_stream_ends_it_with_an_error_event_soon(faults: Faults) -> None:
    worker = faults.system.start_worker(QUEUE, name="genfault-doomed")

    def kill() -> None:
        os.kill(worker.popen.pid, signal.SIGKILL)  # the worker process: its threads generate

    status, events, took = stream_until_cut(faults, kill)
    assert status == 200, events
    worker.popen.wait(10)
    assert events and "[DONE]" not in events, events[-3:]
    error = events[-1].get("error")
    assert error is not None, events[-3:]
    assert error["code"] == "worker_lost" and error["type"] == "server_error", error
    assert "genfault-doomed" in error["message"] and "TRAINQ_WORKER_STALE_S" in error["message"]
    # Seen within the registry's staleness and a liveness look, not at the 120 s deadline
    # (a generous bound: a guard against waiting for the deadline, not a timing claim).
    assert took < 60, took


def test_extreme_but_valid_sampling_gets_an_answer(faults: Faults) -> None:
    faults.system.start_worker(QUEUE, name="genfault-sampler")
    greedy = {"model": faults.job_id, "prompt": "Once upon a ", "max_tokens": 8, "seed": 3}
    with faults.api.client() as c:
        ref = c.post("/v1/completions", json={**greedy, "temperature": 0}, timeout=60)
        assert ref.status_code == 200, ref.text
        expected = ref.json()["choices"][0]["token_ids"]
        for extra in ({"temperature": 1e-45}, {"top_p": 1e-300},
                      {"temperature": 1e-30, "top_p": 1e-300, "top_k": 2}):  # fmt: skip
            r = c.post("/v1/completions", json={**greedy, **extra}, timeout=60)
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["token_ids"] == expected, extra


def test_redis_gone_mid_stream_ends_it_with_the_documented_error_event(faults: Faults) -> None:
    # Runs last: it ends this module's system (its private Redis).
    faults.system.start_worker(QUEUE, name="genfault-survivor")
    status, events, took = stream_until_cut(faults, faults.redis.kill)
    assert status == 200, events
    assert events and "[DONE]" not in events, events[-3:]
    error = events[-1].get("error")
    assert error is not None, events[-3:]
    assert error["code"] == "service_unavailable" and "Redis" in error["message"], error
    assert took < 60, took
    # The API handled it: no unhandled exception in its log, and it still answers.
    log = Path(faults.api.proc.log).read_text(errors="replace")
    assert "Exception in ASGI application" not in log, log[-3000:]
    assert httpx.get(f"{faults.api.url}/healthz", timeout=10).status_code in (200, 503)
