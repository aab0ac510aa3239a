"""Admission between tenants (issue 22): what one owner learns of the others (pending
reasons and ``GET /v1/queues`` show other owners as counts, names only to an admin), and
that a stream of urgent jobs cannot starve a queue (priority aging, a preemption budget per
job). ``decide`` is asked directly on plain values; the admitter runs against the real
stores (PostgreSQL, Redis), with workers as registry entries (tests/api/test_admit.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import update

from service.api.core.models import ATTEMPTS
from service.api.jobs.state import attempt_exited
from service.api.scheduling.decide import Held, Pending, Waiting, Worker, decide
from tests.api.support import Api
from tests.api.test_admit import admit_api, admitter, entry, names, placement

__all__ = ["admit_api"]  # the fixture, shared with tests/api/test_admit.py


def _as(api: Api, token: str, path: str) -> Any:
    resp = api.client.get(path, headers=api.headers(token))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _submit_as(api: Api, token: str, **spec: Any) -> dict[str, Any]:
    body = {"name": "t", "queue": api.queue, "train": {"steps": 5}, **spec}
    resp = api.client.post("/v1/jobs", json=body, headers=api.headers(token))
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


# -- What one tenant sees of another ---------------------------------------------------------


def test_pending_reasons_and_queues_name_other_owners_only_to_an_admin(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    entry(api, w, [api.queue])
    mine = api.submit()
    admitter(api).run_once()
    assert placement(api, mine["id"]) == [w]
    bob_jobs = [_submit_as(api, api.other_token) for _ in range(2)]
    bob = bob_jobs[0]["owner"]
    waiting = api.submit(priority=-1)  # behind both of bob's
    secret = f"{api.queue}-bob-only"  # a queue no worker serves; only bob's job names it
    _submit_as(api, api.other_token, queue=secret)
    admitter(api).run_once()

    # alice reads her queued job: bob's two jobs ahead are counted, not named.
    why = api.get(waiting["id"])["pending_reason"]
    assert why.startswith(f"position 3 in queue {api.queue}: waiting for capacity"), why
    assert "ahead: other owners (2)" in why and bob not in why, why
    # an admin reads the names
    as_admin = _as(api, api.admin_token, f"/v1/jobs/{waiting['id']}")["pending_reason"]
    assert as_admin.endswith(f"ahead: {bob} (2)"), as_admin

    # GET /v1/queues: alice's own groups by name, bob's as counts; bob's queue not listed.
    body = _as(api, api.token, "/v1/queues")
    assert bob not in json.dumps(body) and secret not in [q["name"] for q in body["items"]]
    [q] = [q for q in body["items"] if q["name"] == api.queue]
    assert q["queued"] == 3 and q["running"] == 1, q
    assert q["queued_by"] == [
        {"owner": None, "priority": 0, "jobs": 2},
        {"owner": api.user, "priority": -1, "jobs": 1},
    ], q
    assert q["running_by"] == [{"owner": api.user, "jobs": 1, "units": 1}], q

    # bob sees his own queue and names, alice as a count
    body = _as(api, api.other_token, "/v1/queues")
    assert api.user not in json.dumps(body)
    by_name = {q["name"]: q for q in body["items"]}
    assert by_name[secret]["queued_by"] == [{"owner": bob, "priority": 0, "jobs": 1}]
    assert by_name[api.queue]["running_by"] == [{"owner": None, "jobs": 1, "units": 1}]
    assert by_name[api.queue]["queued_by"] == [
        {"owner": bob, "priority": 0, "jobs": 2},
        {"owner": None, "priority": -1, "jobs": 1},
    ]

    # an admin sees every queue and every name
    body = _as(api, api.admin_token, "/v1/queues")
    by_name = {q["name"]: q for q in body["items"]}
    assert by_name[secret]["workers"] == 0
    assert by_name[api.queue]["queued_by"] == [
        {"owner": bob, "priority": 0, "jobs": 2},
        {"owner": api.user, "priority": -1, "jobs": 1},
    ]


def test_a_pending_reason_names_other_jobs_only_to_an_admin() -> None:
    why = Pending(
        "waiting for capacity: needs 1 slot(s) of 1 rank(s) on queue q, 0 free",
        owner="alice",
        position=4,
        queue="q",
        ahead=(("bob", 2), ("alice", 1)),
        ahead_total=3,
        ahead_own=1,
        preempting=("0bad",),
        yielding=("0bee", "0bef"),
    )
    again = Pending.loads(why.dumps())
    assert again == why, "the stored record reads back whole"
    owner = again.text(admin=False)
    assert owner == (
        "position 4 in queue q: waiting for capacity: needs 1 slot(s) of 1 rank(s) on queue q,"
        " 0 free; job(s) 2 are checkpointing to yield theirs; preempting lower-priority job(s)"
        " 1; ahead: alice (1), other owners (2)"
    ), owner
    admin = again.text(admin=True)
    assert "job(s) 0bee, 0bef are checkpointing" in admin and "job(s) 0bad" in admin
    assert admin.endswith("ahead: bob (2), alice (1)"), admin
    # A value that is not a record (an older admitter's plain text) is not shown.
    assert Pending.loads("position 1 in queue q: ...; ahead: bob (3)") is None
    assert Pending.loads(b'{"why": 3}') is None


# -- Aging and the preemption budget, on plain values ----------------------------------------

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _w(name: str = "w", free: int = 1) -> Worker:
    return Worker(name, frozenset({"q"}), slots=1, slot_procs=8, gpus_per_slot=0, free=free)


def _wait(job: str, owner: str, priority: int, waited_s: float) -> Waiting:
    return Waiting(job, 1, owner, "q", 1, 1, priority, None, NOW - timedelta(seconds=waited_s))


def _held(job: str, priority: int, preemptions: int = 0) -> Held:
    at = NOW - timedelta(seconds=30)
    return Held(job, 1, "o", "q", 1, 1, priority, ["w"], at, None, "running", preemptions)


def test_decide_ages_a_waiting_job_up_to_a_bound() -> None:
    normal = _wait("0001", "a", 0, waited_s=600)  # ten minutes in the queue
    urgent = _wait("0002", "b", 5, waited_s=1)
    aging = {"aging_s": 60.0, "aging_max": 10}
    # Without aging the urgent job goes first, whatever the normal one waited.
    assert list(decide([_w()], [normal, urgent], [], {}, now=NOW).place) == [("0002", 1)]
    # +1 per minute: ten minutes make it priority 10, ahead of the urgent 5.
    plan = decide([_w()], [normal, urgent], [], {}, now=NOW, **aging)
    assert list(plan.place) == [("0001", 1)]
    # Bounded: a day's wait is still +10, below an urgent 11.
    ancient = _wait("0001", "a", 0, waited_s=86_400)
    urgent11 = _wait("0002", "b", 11, waited_s=1)
    plan = decide([_w()], [ancient, urgent11], [], {}, now=NOW, **aging)
    assert list(plan.place) == [("0002", 1)]
    # The reason says what aging added.
    plan = decide([_w(free=0)], [normal, urgent], [], {}, now=NOW, **aging)
    [(first, why), (second, _)] = plan.reasons["q"]
    assert (first, second) == ("0001", "0002")
    assert why.text(admin=False).startswith(
        "position 1 in queue q (priority +10 for its time waiting): waiting for capacity"
    ), why


def test_aging_orders_but_never_preempts() -> None:
    # The aged normal job (0 +10) waits first; it does not preempt an equal-priority run,
    # and the urgent job behind it may not preempt while it waits (first in line only).
    running = [_held("run", 0)]
    waiting = [_wait("0001", "a", 0, waited_s=600), _wait("0002", "b", 5, waited_s=1)]
    plan = decide([_w(free=0)], waiting, running, {}, now=NOW, aging_s=60.0, aging_max=10)
    assert plan.preempt == [] and plan.place == {}
    # Without aging the urgent job is first and preempts the run.
    plan = decide([_w(free=0)], waiting, running, {}, now=NOW)
    assert [v.job_id for v, _ in plan.preempt] == ["run"]


def test_a_job_preempted_its_budget_of_times_is_no_longer_a_victim() -> None:
    urgent = [_wait("0009", "b", 5, waited_s=1)]
    for preemptions, budget, victim in [(1, 2, True), (2, 2, False), (5, 0, True)]:
        plan = decide(
            [_w(free=0)],
            urgent,
            [_held("run", 0, preemptions)],
            {},
            now=NOW,
            preempt_budget=budget,
        )
        assert bool(plan.preempt) is victim, (preemptions, budget)


# -- The admitter against the stores ---------------------------------------------------------


def test_the_admitter_ages_a_long_waiting_job_ahead_of_urgent_ones(admit_api: Api) -> None:
    api = admit_api
    [w] = names(1)
    normal = api.submit()
    # It has waited ten minutes (the attempt's creation is when it began to wait).
    with api.services.sessions() as session, session.begin():
        session.execute(
            update(ATTEMPTS)
            .where(ATTEMPTS.c.job_id == normal["id"])
            .values(created_at=datetime.now(UTC) - timedelta(minutes=10))
        )
    urgent = _submit_as(api, api.admin_token, priority=5)
    entry(api, w, [api.queue])
    done = admitter(api).run_once()
    assert done is not None and done["placed"] == 1, done
    assert placement(api, normal["id"]) == [w], "+10 for ten minutes: ahead of priority 5"
    assert placement(api, urgent["id"]) is None


def test_the_admitter_spares_a_job_that_has_yielded_its_budget(admit_api: Api) -> None:
    api = admit_api  # TRAINQ_PREEMPT_MAX_PER_JOB: the default, 2
    assert api.settings.preempt_max_per_job == 2
    [w] = names(1)
    entry(api, w, [api.queue])
    low = api.submit(priority=-5)
    for attempt in (1, 2):  # it yielded twice already
        admitter(api).run_once()
        assert placement(api, low["id"], attempt) == [w]
        with api.services.sessions() as session, session.begin():
            attempt_exited(
                session, low["id"], attempt, exit_code=None, reason="preempted", message="p"
            )
    admitter(api).run_once()
    assert placement(api, low["id"], 3) == [w]
    high = _submit_as(api, api.admin_token, priority=10)
    done = admitter(api).run_once()
    assert done is not None and done["preempted"] == 0, done
    assert not api.services.redis.exists(api.keys.preempt(low["id"], 3))
    why = _as(api, api.admin_token, f"/v1/jobs/{high['id']}")["pending_reason"]
    assert why.startswith(f"position 1 in queue {api.queue}: waiting for capacity"), why
    assert "preempting" not in why, why
