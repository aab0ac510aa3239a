"""GET /v1/jobs/{id} on PostgreSQL: the JSON the database writes is JobOut's.

The answer is built by SQL (``job_json.aget_job_json``), while SQLite, cancel and a repeated
Idempotency-Key answer with pydantic (``routes.jobs._get``). Both must say the same thing:
same fields in the same order, same values, same datetime format, for a running job with
attempts and metrics, a queued job with its pending reason, and a finished one; the fast
path at the edge and the routed endpoint must return identical bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, update

from service.api.core.auth import Principal
from service.api.core.models import ATTEMPTS, JOBS
from service.api.jobs import router as jobs
from service.api.jobs.schemas import JobOut
from tests.api.support import Api, WorkerSim, register_worker


def _pairs(text: bytes) -> Any:
    """The JSON with its objects as lists of (key, value): key order counts too."""
    return json.loads(text, object_pairs_hook=list)


def _answers(api: Api, job_id: str) -> tuple[bytes, bytes, bytes]:
    """(the fast path over HTTP, the routed endpoint's function, pydantic's answer)."""
    api.services._workers = (0.0, [])  # the one-second cache of live workers
    fast = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers())
    assert fast.status_code == 200, fast.text
    principal = Principal(api.user)
    routed = asyncio.run(jobs.get_job(job_id, api.services, principal)).body
    api.services._workers = (0.0, [])
    pydantic = jobs._get(api.services, principal, job_id).body
    return fast.content, bytes(routed), bytes(pydantic)


def _check(api: Api, job_id: str) -> dict[str, Any]:
    fast, routed, pydantic = _answers(api, job_id)
    assert fast == routed
    assert _pairs(fast) == _pairs(pydantic)
    out: dict[str, Any] = json.loads(fast)
    assert list(out) == list(JobOut.model_fields)
    JobOut.model_validate_json(fast)
    return out


def test_running_job_with_attempts_and_metrics(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit(
        name='quote " back \\ é ☃ </script>',
        labels={"team": "ml é", "k": 'v"'},
        retries=2,
        max_runtime_s=3600,
        train={"steps": 5, "optim": {"lr": 1e-5, "eps": 1e-12}},
    )
    w = sim(job["id"])
    w.claim()
    w.running()
    w.metric(1)
    w.metric(2, val_loss=3.25, mfu=0.41)
    w.metric(3, loss=7, tokens_per_s=1.5e20)
    api.drain()
    out = _check(api, job["id"])
    assert out["status"] == "running"
    assert out["latest"] == {
        "step": 3,
        "steps": 5,
        "loss": 7.0,
        "val_loss": 3.25,
        "tokens_per_s": 1.5e20,
        "mfu": None,
    }
    assert out["attempts"][0]["host"] == "h1" and out["attempts"][0]["status"] == "running"
    assert out["name"] == job["name"] and out["labels"] == {"team": "ml é", "k": 'v"'}


def test_queued_job_with_pending_reason(api: Api) -> None:
    first = api.submit()
    assert _check(api, first["id"])["pending_reason"] == f"no worker serves queue {api.queue}"
    register_worker(api, [api.queue], name="w-live")
    second = api.submit()
    assert _check(api, first["id"])["pending_reason"] == f"position 1 in queue {api.queue}"
    assert _check(api, second["id"])["pending_reason"] == f"position 2 in queue {api.queue}"


def test_finished_jobs_and_whole_second_times(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit(retries=1)
    w = sim(job["id"])
    w.claim()
    w.running()
    w.metric(1)
    w.exited(1, "exit_code", "rank 0 exited with code 1\nTraceback: ...")
    api.drain()
    api.reconciler().run_once()  # the retry: attempt 2, re-sent
    w2 = sim(job["id"], 2)
    w2.claim()
    w2.running()
    w2.exited(0)
    api.drain()
    # pydantic leaves out the fraction of a whole second (and keeps trailing zeros of
    # others); the SQL must do the same.
    with api.services.engine.begin() as conn:
        conn.execute(
            update(JOBS)
            .where(JOBS.c.id == job["id"])
            .values(
                created_at=func.date_trunc("second", JOBS.c.created_at),
                ended_at=func.date_trunc("second", JOBS.c.ended_at) + timedelta(microseconds=5e5),
            )
        )
        conn.execute(
            update(ATTEMPTS)
            .where(ATTEMPTS.c.job_id == job["id"], ATTEMPTS.c.number == 1)
            .values(started_at=func.date_trunc("second", ATTEMPTS.c.started_at))
        )
    out = _check(api, job["id"])
    assert out["status"] == "succeeded", out
    assert [a["status"] for a in out["attempts"]] == ["exited", "exited"]
    assert out["attempts"][0]["exit_code"] == 1 and "\n" in out["attempts"][0]["message"]
    assert "." not in out["created_at"]
    assert out["ended_at"].endswith(".500000Z")
    assert "." not in out["attempts"][0]["started_at"]
