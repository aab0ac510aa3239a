"""The admitter (service.api.scheduling.admit) against the real stores: PostgreSQL, Redis, the
Celery broker's lists. Workers here are registry entries written as a worker writes them (the
worker itself is tested in tests/worker and end to end in tests/e2e/test_scheduler.py); what
is asserted is what the admitter reads and writes: placements in SQL, messages in each
worker's own broker queue, pending reasons, preemption flags. ``decide`` is also asked
directly, on plain values, for the orderings that need no store."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.api.app import create_app
from service.api.core.models import ATTEMPTS, JOBS
from service.api.core.settings import Settings
from service.api.scheduling.admit import Admitter
from service.api.scheduling.decide import Held, Waiting, Worker, decide
from tests.api.support import Api, forget_jobs_since, make_tokens
from worker.message import JobMessage, worker_queue


@pytest.fixture()
def admit_api(make_settings: Callable[..., Settings]) -> Iterator[Api]:
    started_ms = int(time.time() * 1000)
    app = create_app(make_settings(scheduler="admit", preempt_min_interval_s=0))
    user, token, other, admin = make_tokens(app.state.services)
    try:
        with TestClient(app) as client:
            yield Api(app, client, app.state.services, user, token, other, admin)
    finally:
        forget_jobs_since(app.state.services.settings.database_url, started_ms)


def entry(api: Api, name: str, queues: list[str], *, slots: int = 1, procs: int = 8) -> None:
    """A worker's registry entry, as worker.registry.Registry.entry() writes it."""
    info = {
        "name": name,
        "host": "h",
        "queues": queues,
        "slots": slots,
        "gpus": None,
        "slot_procs": procs,
        "gpus_per_slot": 0,
        "running": [],
        "busy": 0,
        "draining": False,
        "ts": time.time(),
    }
    api.services.redis.hset(api.keys.workers, name, json.dumps(info))


def admitter(api: Api) -> Admitter:
    s = api.services
    return Admitter(s.settings, s.sessions, s.redis, s.dispatcher)


def placement(api: Api, job_id: str, attempt: int = 1) -> list[str] | None:
    with api.services.sessions() as session:
        value = session.execute(
            select(ATTEMPTS.c.placement).where(
                ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.number == attempt
            )
        ).scalar()
    return list(value) if value is not None else None


def messages(api: Api, worker: str) -> list[JobMessage]:
    """The job messages waiting in ``worker``'s own broker queue (Celery's JSON envelope:
    a base64 body of ``[args, kwargs, embed]``)."""
    broker = api.services.dispatcher.broker_client()
    out = []
    for raw in broker.lrange(worker_queue(worker, api.settings.redis_prefix), 0, -1):
        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0]
        out.append(JobMessage.from_json(args[0]))
    return out


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"w{i}-{tag}" for i in range(n)]


def test_two_gangs_on_three_slots_one_is_placed_whole_the_other_waits(admit_api: Api) -> None:
    api = admit_api
    workers = names(3)
    for w in workers:
        entry(api, w, [api.queue])
    first = api.submit(nodes=2)
    second = api.submit(nodes=2)
    done = admitter(api).run_once()
    assert done is not None and done["placed"] == 1 and done["sent"] == 1, done
    chosen = placement(api, first["id"])
    assert chosen is not None and len(set(chosen)) == 2 and set(chosen) <= set(workers)
    assert placement(api, second["id"]) is None, "a gang is placed whole or not at all"
    # Each node's message went to its own worker's queue, and nowhere else.
    for node, w in enumerate(chosen):
        [msg] = messages(api, w)
        assert (msg.job_id, msg.attempt, msg.node_rank, msg.nodes) == (first["id"], 1, node, 2)
    [idle] = set(workers) - set(chosen)
    assert messages(api, idle) == []
    assert api.services.dispatcher.broker_client().llen(api.broker_queue) == 0
    placed = api.get(first["id"])
    assert placed["status"] == "queued", placed
    assert placed["pending_reason"] == (
        f"admitted: attempt 1 placed (node 0 on {chosen[0]}, node 1 on {chosen[1]});"
        " waiting for it to start"
    ), placed
    why = api.get(second["id"])["pending_reason"]
    assert why.startswith(f"position 1 in queue {api.queue}: waiting for capacity"), why
    assert "needs 2 slot(s) of 1 rank(s)" in why and "1 free" in why, why
    # A pass with nothing new changes nothing and sends nothing again.
    again = admitter(api).run_once()
    assert again is not None and (again["placed"], again["sent"]) == (0, 0), again
    assert len(messages(api, chosen[0])) == 1


def test_slot_size_and_missing_workers_are_pending_reasons(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue], procs=2)
    # A malformed entry (a broken worker) is skipped; it does not stop admission.
    bad = {"name": "bad", "queues": api.queue, "slots": "many", "ts": time.time()}
    api.services.redis.hset(api.keys.workers, f"bad-{w}", json.dumps(bad))
    big = api.submit(procs_per_node=4)
    nobody = api.submit(queue=f"none-{uuid.uuid4().hex[:6]}")
    assert admitter(api).run_once() is not None
    why = api.get(big["id"])["pending_reason"]
    assert f"needs 4 per node; the largest slot on queue {api.queue} has 2" in why, why
    assert placement(api, big["id"]) is None
    assert api.get(nobody["id"])["pending_reason"] == f"no worker serves queue {nobody['queue']}"


def test_a_worker_that_leaves_before_claiming_returns_its_capacity(admit_api: Api) -> None:
    api = admit_api
    gone, alive = names(2)
    entry(api, gone, [api.queue])
    job = api.submit()
    admitter(api).run_once()
    assert placement(api, job["id"]) == [gone]
    assert len(messages(api, gone)) == 1
    # It vanishes (its entry goes stale, as when its heartbeat stops) and another joins.
    api.services.redis.hdel(api.keys.workers, gone)
    entry(api, alive, [api.queue])
    done = admitter(api).run_once()
    assert done is not None and done["unplaced"] == 1, done
    done = admitter(api).run_once() if placement(api, job["id"]) is None else done
    assert placement(api, job["id"]) == [alive]
    assert messages(api, gone) == [], "its message was taken out of the dead worker's queue"
    assert [m.job_id for m in messages(api, alive)] == [job["id"]]
    # A claimed attempt is not taken back: the heartbeat reaper decides about it.
    api.services.redis.set(api.keys.claim(job["id"], 1), alive)
    api.services.redis.hdel(api.keys.workers, alive)
    entry(api, gone, [api.queue])
    done = admitter(api).run_once()
    assert done is not None and done["unplaced"] == 0 and placement(api, job["id"]) == [alive]


def test_the_admitter_and_the_reconciler_never_both_send_one_attempt(admit_api: Api) -> None:
    api = admit_api
    workers = names(2)
    for w in workers:
        entry(api, w, [api.queue], slots=10)
    jobs = [api.submit(nodes=2)["id"] for _ in range(6)]
    rec = api.reconciler()
    errors: list[BaseException] = []

    def loop(fn: Callable[[], Any]) -> None:
        try:
            for _ in range(15):
                fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(admitter(api).run_once,)),
        threading.Thread(target=loop, args=(admitter(api).run_once,)),
        threading.Thread(target=loop, args=(lambda: rec.run_once(orphans=True),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    sent = [(m.job_id, m.node_rank) for w in workers for m in messages(api, w)]
    assert sorted(sent) == sorted((j, n) for j in jobs for n in (0, 1)), "each node once"


def test_preemption_asks_the_newest_lower_priority_job_to_yield(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue])
    low = api.submit(priority=-5)
    admitter(api).run_once()
    assert placement(api, low["id"]) == [w]
    high = api.client.post(
        "/v1/jobs",
        json={"queue": api.queue, "priority": 10, "train": {"steps": 5}},
        headers=api.headers(api.admin_token),
    ).json()
    done = admitter(api).run_once()
    assert done is not None and done["preempted"] == 1, done
    flag = api.services.redis.get(api.keys.preempt(low["id"], 1))
    assert flag is not None and f"preempted by job {high['id']} (priority 10)" in flag.decode()
    admin = api.headers(api.admin_token)
    why = api.client.get(f"/v1/jobs/{high['id']}", headers=admin).json()["pending_reason"]
    assert f"preempting lower-priority job(s) {low['id']}" in why, why
    # While the victim checkpoints, nothing more is preempted and it is named as yielding.
    done = admitter(api).run_once()
    assert done is not None and done["preempted"] == 0, done
    why = api.client.get(f"/v1/jobs/{high['id']}", headers=admin).json()["pending_reason"]
    assert f"job(s) {low['id']} are checkpointing" in why, why
    # The worker reports the preempted exit: the low job is requeued, no retry spent, and
    # the high one takes the slot.
    with api.services.sessions() as session, session.begin():
        from service.api.jobs.state import attempt_exited

        out = attempt_exited(
            session, low["id"], 1, exit_code=None, reason="preempted", message="preempted"
        )
    assert out.to_send == [(low["id"], 2)]
    done = admitter(api).run_once()
    assert placement(api, high["id"]) == [w] and placement(api, low["id"], 2) is None
    job = api.get(low["id"])
    assert (job["status"], job["attempt"], job["retries_used"]) == ("queued", 2, 0), job
    assert job["pending_reason"].startswith(f"position 1 in queue {api.queue}"), job


def test_get_queues_shows_capacity_use_and_queued_by_owner(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue], slots=2, procs=4)
    # A malformed entry (a broken worker) is left out here too, not a 500.
    bad = {"name": "bad", "queues": [api.queue], "slots": "many", "ts": time.time()}
    api.services.redis.hset(api.keys.workers, f"bad-{w}", json.dumps(bad))
    running = api.submit()
    api.submit(priority=-1)
    api.submit(priority=-1)
    admitter(api).run_once()
    assert placement(api, running["id"]) == [w]
    [q] = [q for q in api.client.get("/v1/queues", headers=api.headers()).json()["items"]
           if q["name"] == api.queue]  # fmt: skip
    assert (q["workers"], q["slots"], q["largest_slot_procs"]) == (1, 2, 4), q
    assert q["running_by"] == [{"owner": api.user, "jobs": 2, "units": 2}], q
    assert q["queued"] == 1 and q["queued_by"] == [{"owner": api.user, "priority": -1, "jobs": 1}]


def _w(name: str, free: int = 1) -> Worker:
    return Worker(
        name, frozenset({"q"}), slots=max(1, free), slot_procs=8, gpus_per_slot=0, free=free
    )


def _job(i: int, owner: str, priority: int = 0, nodes: int = 1) -> Waiting:
    return Waiting(f"{i:04x}", 1, owner, "q", nodes, 1, priority)


def test_decide_orders_by_priority_then_fair_share_then_submit_time() -> None:
    now = datetime.now(UTC)
    waiting = [_job(i, "a") for i in range(1, 6)] + [_job(9, "b")]
    # Equal use: owners alternate within a pass; a's earlier jobs do not all go first.
    plan = decide([_w("w", free=2)], waiting, [], {}, now=now)
    assert sorted(j for j, _ in plan.place) == ["0001", "0009"]
    # a has used more: b's job is the first placed.
    plan = decide([_w("w")], waiting, [], {"a": 100.0}, now=now)
    assert list(plan.place) == [("0009", 1)]
    order = [job for job, _ in plan.reasons["q"]]
    assert order == ["0001", "0002", "0003", "0004", "0005"], "then submit time"
    # Priority beats use.
    plan = decide([_w("w")], [*waiting, _job(20, "a", priority=1)], [], {"a": 100.0}, now=now)
    assert list(plan.place) == [("0014", 1)]
    # A running quota of 1: the owner's second job waits though a slot is free.
    plan = decide([_w("w", free=3)], waiting[:2], [], {}, now=now, default_cap=1)
    assert list(plan.place) == [("0001", 1)]
    why = plan.reasons["q"][0][1].text(admin=False)
    assert "waiting for quota: owner a holds 1 of its 1 slots" in why, why


def test_decide_preempts_the_fewest_newest_victims() -> None:
    now = datetime.now(UTC)

    def held(job: str, prio: int, age_s: float, workers: list[str]) -> Held:
        at = now - timedelta(seconds=age_s)
        return Held(job, 1, "o", "q", len(workers), 1, prio, workers, at, None, "running")

    workers = [_w("w1", 0), _w("w2", 0), _w("w3", 0)]
    running = [held("old", 0, 100, ["w1"]), held("new", 0, 10, ["w2"]), held("top", 5, 1, ["w3"])]
    plan = decide(workers, [_job(1, "x", priority=3)], running, {}, now=now)
    assert [v.job_id for v, _ in plan.preempt] == ["new"], "one victim, the newest, lower only"
    plan = decide(workers, [_job(1, "x", priority=3, nodes=2)], running, {}, now=now)
    assert sorted(v.job_id for v, _ in plan.preempt) == ["new", "old"]
    # Nothing of lower priority could make room: nobody is preempted.
    plan = decide(workers, [_job(1, "x", priority=3, nodes=3)], running, {}, now=now)
    assert plan.preempt == []
    # Preempted recently (within the interval): not again.
    running[1].preempted_at = now - timedelta(seconds=5)
    running[1].created_at = now - timedelta(seconds=1)
    plan = decide(workers, [_job(1, "x", priority=3)], running, {}, now=now, preempt_interval_s=60)
    assert [v.job_id for v, _ in plan.preempt] == ["old"]


def test_a_job_held_back_after_its_gang_failed_waits_until_its_backoff(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue])
    job = api.submit()
    until = datetime.now(UTC) + timedelta(seconds=60)
    with api.services.sessions() as session, session.begin():
        session.execute(update(JOBS).where(JOBS.c.id == job["id"]).values(not_before=until))
    admitter(api).run_once()
    assert placement(api, job["id"]) is None
    assert "backing off after its gang failed to start" in api.get(job["id"])["pending_reason"]


def test_the_waiting_set_follows_cancels_retries_and_another_replica(admit_api: Api) -> None:
    """The admitter reads only new attempts between full reads (Admitter._waiting): a cancel,
    a retry's new attempt and another replica's placements must all show in its order."""
    from service.api.jobs.state import attempt_exited, attempt_lost

    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue])
    mine, other = admitter(api), admitter(api)  # two API replicas
    busy = api.submit()
    mine.run_once()
    assert placement(api, busy["id"]) == [w]
    first, second = api.submit(), api.submit(retries=1)
    mine.run_once()
    assert api.get(second["id"])["pending_reason"].startswith(f"position 2 in queue {api.queue}")
    cancelled = api.client.post(f"/v1/jobs/{first['id']}/cancel", headers=api.headers())
    assert cancelled.json()["status"] == "cancelled"
    mine.run_once()
    assert api.get(second["id"])["pending_reason"].startswith(f"position 1 in queue {api.queue}")
    # The slot frees; the other replica places the next job; this one must not place it again.
    with api.services.sessions() as session, session.begin():
        attempt_exited(session, busy["id"], 1, exit_code=0, reason=None, message="ok")
    assert (other.run_once() or {})["placed"] == 1
    assert placement(api, second["id"]) == [w]
    third = api.submit()
    done = mine.run_once()
    assert done is not None and done["placed"] == 0 and done["sent"] == 0, done
    assert len(messages(api, w)) == 2, "busy's and second's: nothing sent twice"
    assert api.get(third["id"])["pending_reason"].startswith(f"position 1 in queue {api.queue}")
    # second's attempt is lost: its retry is a new attempt (found by this replica without a
    # full read) and, submitted before third, it takes the freed slot first.
    with api.services.sessions() as session, session.begin():
        attempt_lost(session, second["id"], 1, message="gone")
    done = mine.run_once()
    assert done is not None and done["placed"] == 1, done
    assert placement(api, second["id"], 2) == [w] and placement(api, third["id"]) is None
