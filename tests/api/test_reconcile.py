"""The reconciler and the retry rules: lost heartbeats, preemption, unsent jobs, cancel."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.core.models import ATTEMPTS
from service.api.scheduling.reconcile import Reconciler
from tests.api.support import Api, WorkerSim, closed_url, make_tokens


def _pass(rec: Reconciler) -> dict[str, int]:
    out = rec.run_once()
    assert out is not None, "the lock was free, so the pass must run"
    return out


def _queue_len(api: Api) -> int:
    import redis

    broker = redis.Redis.from_url(api.settings.broker_url)
    try:
        return int(broker.llen(api.broker_queue))
    finally:
        broker.close()


def test_lost_heartbeat_retries_then_fails(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit(retries=1)
    w1 = sim(job["id"], 1)
    w1.claim()
    w1.running()
    api.drain()
    rec = api.reconciler()
    assert rec.run_once() == {"sent": 0, "lost": 0}  # beating: nothing to do
    w1.stop_heartbeat()  # the worker host died
    assert rec.run_once() == {"sent": 0, "lost": 1}
    got = api.get(job["id"])
    assert got["status"] == "queued" and got["attempt"] == 2 and got["retries_used"] == 1
    assert [a["status"] for a in got["attempts"]] == ["lost", "dispatched"]
    assert got["attempts"][0]["reason"] == "lost"
    assert _queue_len(api) == 2  # the first attempt, and the retry sent at once
    # Its host may only be cut off: once back, its run must stop (worker.supervise), or it
    # holds the slot the retry may be waiting for. The retry is not told to stop.
    assert api.services.redis.exists(api.keys.stop(job["id"], 1))
    assert not api.services.redis.exists(api.keys.stop(job["id"], 2))

    # A late exit of the lost attempt changes nothing now.
    w1.exited(0)
    api.drain()
    assert api.get(job["id"])["attempt"] == 2

    w2 = sim(job["id"], 2)
    w2.claim()
    w2.running()
    api.drain()
    assert api.get(job["id"])["status"] == "running"
    w2.stop_heartbeat()
    assert _pass(rec)["lost"] == 1
    final = api.get(job["id"])
    assert final["status"] == "failed" and final["reason"] == "lost"
    assert len(final["attempts"]) == 2


def test_claimed_but_never_running_is_lost_unclaimed_waits(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    waiting = api.submit()
    claimed = api.submit()
    w = sim(claimed["id"])
    w.claim()
    w.stop_heartbeat()  # claimed, then the worker died before launching
    assert _pass(api.reconciler())["lost"] == 1
    assert api.get(claimed["id"])["status"] == "failed"
    assert api.get(waiting["id"])["status"] == "queued"  # still in the Celery queue


def test_heartbeat_grace(api: Api, sim: Callable[..., WorkerSim], make_settings: Any) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.claim()
    w.running()
    api.drain()
    w.stop_heartbeat()
    from service.api.scheduling.reconcile import Reconciler

    s = api.services
    patient = Reconciler(
        make_settings(redis_prefix=api.settings.redis_prefix, heartbeat_grace_s=60),
        s.sessions,
        s.redis,
        s.dispatcher,
    )
    assert _pass(patient)["lost"] == 0  # missing once: only noted
    with s.sessions() as session:
        from sqlalchemy import select

        since = session.execute(
            select(ATTEMPTS.c.hb_missing_since).where(ATTEMPTS.c.job_id == job["id"])
        ).scalar_one()
    assert since is not None
    w.claim()  # it came back
    assert _pass(patient)["lost"] == 0
    assert api.get(job["id"])["status"] == "running"


def test_an_exit_sent_but_not_ingested_is_not_lost(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Any
) -> None:
    """The race of issue 22: the worker sent its exit and dropped its heartbeat, and the
    ingest lags (an API under load) past the grace. The reaper must wait for the ingest."""
    s = api.services
    hasty = Reconciler(
        make_settings(redis_prefix=api.settings.redis_prefix, heartbeat_grace_s=0),
        s.sessions,
        s.redis,
        s.dispatcher,
    )
    job = api.submit(retries=0)
    w = sim(job["id"])
    w.claim()
    w.running()
    api.drain()
    w.exited(0)  # on the stream, not ingested yet
    w.hand_over()
    assert _pass(hasty)["lost"] == 0, "an exit in flight is not a loss, even with no grace"
    assert api.get(job["id"])["status"] == "running"
    api.drain()
    got = api.get(job["id"])
    assert got["status"] == "succeeded" and got["attempts"][0]["status"] == "exited"

    # The marker is bounded: an exit that is never ingested (lost from the stream) still
    # ends as lost once the marker has expired.
    stuck = api.submit(retries=0)
    w = sim(stuck["id"])
    w.claim()
    w.running()
    api.drain()
    w.hand_over(ttl_ms=1)
    import time

    time.sleep(0.05)
    assert _pass(hasty)["lost"] == 1
    assert api.get(stuck["id"])["reason"] == "lost"


def test_retry_rules(api: Api, sim: Callable[..., WorkerSim]) -> None:
    outcomes = {}
    for reason, code in [
        ("oom", 76),
        ("exit_code", 1),
        ("nan_loss", 75),
        ("spec_error", 64),
        ("timeout", None),
    ]:
        job = api.submit(retries=3)
        w = sim(job["id"])
        w.running()
        w.exited(code, reason, f"{reason} happened")
        api.drain()
        got = api.get(job["id"])
        outcomes[reason] = (got["status"], got["attempt"], got["retries_used"])
    assert outcomes == {
        "oom": ("queued", 2, 1),
        "exit_code": ("queued", 2, 1),
        "nan_loss": ("failed", 1, 0),
        "spec_error": ("failed", 1, 0),
        "timeout": ("failed", 1, 0),
    }


def test_preempted_retries_without_spending_one(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit(retries=0)
    for attempt in (1, 2):
        w = sim(job["id"], attempt)
        w.running()
        w.exited(None, "preempted", "spot instance reclaimed")
        api.drain()
    got = api.get(job["id"])
    assert got["status"] == "queued" and got["attempt"] == 3 and got["retries_used"] == 0
    assert "preempted" in got["message"]
    w = sim(job["id"], 3)
    w.running()
    w.exited(1, "exit_code", "boom")
    api.drain()
    final = api.get(job["id"])
    assert final["status"] == "failed" and final["reason"] == "exit_code"  # no retries left


def test_unsent_job_is_sent_by_the_reconciler(api: Api, make_settings: Callable[..., Any]) -> None:
    down = create_app(
        make_settings(broker_url=closed_url("redis"), redis_prefix=api.settings.redis_prefix)
    )
    _, token, *_ = make_tokens(down.state.services)
    with TestClient(down) as client:
        resp = client.post(
            "/v1/jobs",
            json={"queue": api.queue, "train": {}},
            headers={"Authorization": f"Bearer {token}"},
        )
    assert resp.status_code == 201, resp.text  # committed; the send failed quietly
    job_id = resp.json()["id"]
    assert _queue_len(api) == 0
    assert api.reconciler().run_once() == {"sent": 1, "lost": 0}
    assert _queue_len(api) == 1
    assert api.reconciler().run_once() == {"sent": 0, "lost": 0}  # marked sent
    import redis

    broker = redis.Redis.from_url(api.settings.broker_url)
    raw = json.loads(broker.lindex(api.broker_queue, 0) or b"{}")
    broker.close()
    assert raw["headers"]["argsrepr"].find(job_id) >= 0


def test_a_sent_message_the_broker_lost_is_sent_again(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    import redis

    lost, claimed, waiting = (api.submit()["id"] for _ in range(3))
    broker = redis.Redis.from_url(api.settings.broker_url)
    try:
        assert broker.llen(api.broker_queue) == 3
        # The broker loses its data (a restart without persistence), except the message of
        # `waiting`, sent again by someone; `claimed` was taken by a worker just before.
        keep = [m for m in broker.lrange(api.broker_queue, 0, -1) if waiting.encode() in m]
        broker.delete(api.broker_queue)
        broker.rpush(api.broker_queue, *keep)
        sim(claimed, 1).claim()
        rec = api.reconciler()
        # Seen missing once: perhaps a worker took it this instant and is about to claim it.
        assert rec.run_once(orphans=True) == {"sent": 0, "lost": 0, "orphaned": 0}
        assert rec.run_once(orphans=True) == {"sent": 0, "lost": 0, "orphaned": 1}
        tags = [
            json.loads(m)["headers"]["argsrepr"] for m in broker.lrange(api.broker_queue, 0, -1)
        ]
        assert sorted(tags) == sorted(
            [f"(job {waiting} attempt 1 node 0)", f"(job {lost} attempt 1 node 0)"]
        )
        # Found in its queue again: nothing more to send, however often it looks.
        assert rec.run_once(orphans=True)["orphaned"] == 0  # type: ignore[index]
        assert rec.run_once(orphans=True)["orphaned"] == 0  # type: ignore[index]
        assert broker.llen(api.broker_queue) == 2
        assert api.get(lost)["status"] == "queued"
    finally:
        broker.close()


def test_one_reconciler_at_a_time(api: Api) -> None:
    r = api.services.redis
    rec = api.reconciler()
    r.set(rec.lock_key, "someone-else", px=5000)
    assert rec.run_once() is None
    r.delete(rec.lock_key)
    assert rec.run_once() is not None
    assert r.get(rec.lock_key) is None  # released after the pass


def test_cancel_queued_at_once(api: Api) -> None:
    job = api.submit()
    resp = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert resp.status_code == 200
    got = resp.json()
    assert got["status"] == "cancelled" and got["reason"] == "cancelled"
    assert got["attempts"][0]["status"] == "exited"
    r = api.services.redis
    assert r.get(api.keys.cancel(job["id"])) == b"1"  # the worker checks it before launching
    again = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    # The reconciler does not send a cancelled job.
    assert api.reconciler().run_once() == {"sent": 0, "lost": 0}


def test_cancel_running_waits_for_the_worker(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.claim()
    w.running()
    api.drain()
    r = api.services.redis
    sub = r.pubsub()
    sub.subscribe(api.keys.cancel_channel())
    assert sub.get_message(timeout=2)["type"] == "subscribe"
    resp = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert resp.json()["status"] == "cancelling"
    assert r.get(api.keys.cancel(job["id"])) == b"1"
    message = sub.get_message(timeout=2)
    sub.close()
    assert message is not None and message["data"] == job["id"].encode()
    assert (
        api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers()).json()["status"]
        == "cancelling"
    )
    w.exited(None, "cancelled", "SIGTERM after cancel")
    api.drain()
    final = api.get(job["id"])
    assert final["status"] == "cancelled" and final["attempts"][0]["reason"] == "cancelled"


def test_cancel_of_another_owners_job_is_404(api: Api) -> None:
    job = api.submit()
    resp = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers(api.other_token))
    assert resp.status_code == 404
    assert api.get(job["id"])["status"] == "queued"
