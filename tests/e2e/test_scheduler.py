"""Admission end to end (service.api.scheduling.admit): the API process admits, three real `trainq
worker` processes of one slot each run what it places.

The workers serve overlapping queues, so one system gives each test the shape it needs:

    worker  queues
    A       gang, fair, quota, prio
    B       gang, quota, ref
    C       gang

- gang (3 slots): two 2-node jobs submitted at once, ten times: both succeed, one after the
  other, and no gang ever times out (each job has exactly one attempt).
- prio (1 slot): a long low-priority job is preempted by a high-priority one; it checkpoints,
  is requeued without spending a retry, resumes after the high one, and its per-step losses
  equal an uninterrupted run's (run meanwhile on queue ref).
- fair (1 slot): owner A submits 5 jobs, then owner B 1: B's job is the second to start.
- quota (2 slots): an owner with a running quota of 1 never runs two jobs at once, though a
  slot is free, and its second job says it waits for quota.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import Api, System, build_system, create_token, wait_for
from tests.e2e.test_system import TRAIN, losses

pytestmark = pytest.mark.timeout(300)

DONE = ("succeeded", "failed", "cancelled")
TINY = {**TRAIN, "steps": 2, "checkpoint": {"every": 0, "keep": 1, "hf": "none"}}
# Long enough to be preempted mid-run (~2 s a 100 steps), a checkpoint every 5 steps.
LONG = {**TRAIN, "steps": 150}


@pytest.fixture(scope="module")
def sched_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    settings = {
        **FAST_SETTINGS,
        "TRAINQ_ADVERTISE_HOST": "127.0.0.1",  # node 0's rendezvous store, on loopback
        "TRAINQ_ADMIT_INTERVAL_S": "0.5",
        "TRAINQ_PREEMPT_MIN_INTERVAL_S": "1",
    }
    system = build_system(
        tmp_path_factory.mktemp("sched"), pg_url, redis_dbs, subprocess_env, settings
    )
    yield system
    system.stop()


class Sched:
    def __init__(self, system: System) -> None:
        self.system = system
        self.api: Api = system.start_api(auth=True)
        self.url = system.env["TRAINQ_DATABASE_URL"]
        tag = uuid.uuid4().hex[:6]
        self.workers = {}
        for short, queues in (
            ("A", "gang,fair,quota,prio"),
            ("B", "gang,quota,ref"),
            ("C", "gang"),
        ):
            name = f"sched-{short}-{tag}"
            system.start_worker(queues, name=name)
            self.workers[short] = name

    def token(self, owner: str, **limits: int) -> str:
        token = create_token(self.url, owner)
        if limits:
            from service.api.core.db import make_engine, make_sessionmaker
            from service.api.core.settings import Settings
            from service.api.scheduling.limits import set_limits

            engine = make_engine(Settings(database_url=self.url))
            try:
                with make_sessionmaker(engine).begin() as session:
                    set_limits(session, owner, **limits)
            finally:
                engine.dispose()
        return token

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.api.url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )

    def submit(self, token: str, queue: str, train: dict[str, Any], **spec: Any) -> str:
        body = {"name": f"sched-{queue}", "queue": queue, "procs_per_node": 1, "train": train}
        with self.client(token) as c:
            r = c.post("/v1/jobs", json={**body, **spec})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def job(self, token: str, job_id: str) -> dict[str, Any]:
        with self.client(token) as c:
            r = c.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait(self, token: str, job_id: str, statuses: tuple[str, ...], timeout: float) -> Any:
        def settled() -> dict[str, Any] | None:
            job = self.job(token, job_id)
            return job if job["status"] in statuses else None

        try:
            return wait_for(settled, timeout, f"job {job_id} to be {statuses}", every=0.2)
        except TimeoutError as exc:
            tails = "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.system.procs)
            raise AssertionError(f"{exc}: {self.job(token, job_id)}\n{tails}") from None

    def cancel(self, token: str, job_id: str) -> None:
        with self.client(token) as c:
            assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 200


@pytest.fixture(scope="module")
def sched(sched_system: System) -> Sched:
    return Sched(sched_system)


def _window(job: dict[str, Any]) -> tuple[datetime, datetime]:
    [attempt] = job["attempts"]
    return (
        datetime.fromisoformat(attempt["started_at"]),
        datetime.fromisoformat(attempt["ended_at"]),
    )


def test_two_gangs_at_once_on_three_slots_run_one_after_the_other_three_times(
    sched: Sched,
) -> None:
    token = sched.token(f"gangs-{uuid.uuid4().hex[:6]}")
    # Three rounds, as the report of lost gangs had them (#22); the race itself has its own
    # deterministic tests (tests/api/test_reconcile.py), so more rounds only cost CI time.
    for round_ in range(3):
        ids: list[str] = []
        threads = [
            threading.Thread(
                target=lambda: ids.append(sched.submit(token, "gang", TINY, nodes=2))  # noqa: B023
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        jobs = [sched.wait(token, j, DONE, 90) for j in ids]
        for job in jobs:
            # One attempt each: no gang timed out and was retried.
            assert (job["status"], len(job["attempts"])) == ("succeeded", 1), (round_, job)
        first, second = sorted(_window(j) for j in jobs)
        assert first[1] <= second[0], f"round {round_}: the two gangs overlapped"


def test_a_high_priority_job_preempts_a_low_one_which_resumes_exactly(sched: Sched) -> None:
    owner = f"prio-{uuid.uuid4().hex[:6]}"
    token = sched.token(owner, max_priority=10)
    reference = sched.submit(token, "ref", LONG)  # the same run, never interrupted
    low = sched.submit(token, "prio", LONG, priority=-1)
    wait_for(
        lambda: (sched.job(token, low)["latest"] or {}).get("step", 0) >= 12,
        60,
        "the low job to pass its second checkpoint",
        every=0.1,
    )
    high = sched.submit(token, "prio", TINY, priority=5)
    job = sched.wait(token, high, DONE, 90)
    assert job["status"] == "succeeded", job
    done = sched.wait(token, low, DONE, 120)
    assert (done["status"], done["retries_used"]) == ("succeeded", 0), done
    first, second = done["attempts"]
    assert first["reason"] == "preempted", first
    assert f"preempted by job {high} (priority 5)" in first["message"], first
    # The preempted attempt's log ends with one line that says so, and no traceback.
    with sched.client(token) as c:
        logs = c.get(f"/v1/jobs/{low}/logs", params={"attempt": 1}).text.splitlines()
    assert not [ln for ln in logs if "Traceback" in ln or "SignalException" in ln], logs[-30:]
    assert logs[-1].startswith(f"[a1 worker stderr] trainq: preempted by job {high}"), logs[-5:]
    assert re.search(r"; stopped at step \d+ \(checkpoint saved\)$", logs[-1]), logs[-1]
    # The high job ran between the low job's two attempts, on the one slot.
    ran = _window(job)
    assert datetime.fromisoformat(first["ended_at"]) <= ran[0]
    assert ran[1] <= datetime.fromisoformat(second["ended_at"])
    ref = sched.wait(token, reference, DONE, 60)
    assert ref["status"] == "succeeded", ref
    with sched.client(token) as c:
        got = losses(c.get(f"/v1/jobs/{low}/metrics", params={"max_points": 100_000}).json())
        want = losses(c.get(f"/v1/jobs/{reference}/metrics", params={"max_points": 100_000}).json())
    assert sorted(got) == sorted(want) == list(range(1, LONG["steps"] + 1))
    assert got == want, {s: (got[s], want[s]) for s in got if got[s] != want[s]}


def test_fair_share_starts_the_other_owners_job_second(sched: Sched) -> None:
    tag = uuid.uuid4().hex[:6]
    a, b = sched.token(f"fair-a-{tag}"), sched.token(f"fair-b-{tag}")
    train = {**TINY, "steps": 20}
    mine = [sched.submit(a, "fair", train) for _ in range(5)]
    theirs = sched.submit(b, "fair", train)
    started = sched.wait(b, theirs, ("running", *DONE), 120)
    assert started["status"] in ("running", "succeeded"), started
    jobs = [sched.job(a, j) for j in mine]
    began = sorted(
        (datetime.fromisoformat(j["started_at"]), j["id"]) for j in [*jobs, started]
        if j["started_at"]
    )  # fmt: skip
    assert [job_id for _, job_id in began][:2] == [mine[0], theirs], began
    for j in mine[1:]:
        sched.cancel(a, j)
    sched.wait(b, theirs, DONE, 60)


def test_a_running_quota_of_one_holds_with_two_free_workers(sched: Sched) -> None:
    owner = f"quota-{uuid.uuid4().hex[:6]}"
    token = sched.token(owner, max_running=1)
    train = {**TRAIN, "steps": 60, "checkpoint": {"every": 0, "keep": 1}}
    first = sched.submit(token, "quota", train)
    second = sched.submit(token, "quota", train)
    sched.wait(token, first, ("running", *DONE), 60)
    waiting = wait_for(
        lambda: (
            "waiting for quota" in (sched.job(token, second)["pending_reason"] or "")
            and sched.job(token, second)
        ),
        10,
        "the second job to say it waits for quota",
    )
    assert f"owner {owner} holds 1 of its 1 slots on queue quota" in waiting["pending_reason"]
    jobs = [sched.wait(token, j, DONE, 90) for j in (first, second)]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], jobs
    one, two = sorted(_window(j) for j in jobs)
    assert one[1] <= two[0], "the owner never held two slots at once"
