"""The whole system end to end: HTTP in, SQL state out, real workers and torchrun in between.

One system for the module (see conftest.py ``fast_system``): the API under uvicorn with auth
on, its ingestor and reconciler, PostgreSQL, Redis, and three Celery workers serving one
queue, each launching the trainer with torchrun (2 ranks, gloo on CPU). The jobs that only
have to fail (deadline, nan_loss, corrupt data) are submitted together when the module
starts, so they run while the first tests wait on theirs. Everything a test
asserts is read back through the API (which reads SQL), the SSE stream, or the process
table; the only other look is at the heartbeat key in Redis, to time the reaper from its
expiry.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import (
    Api,
    Proc,
    SseEvent,
    SseFollower,
    System,
    create_token,
    run_processes,
    wait_for,
)

pytestmark = pytest.mark.timeout(150)

QUEUE = "e2e"
LATE_QUEUE = "e2e-late"  # no worker until a test starts one
STEPS = 100  # ~2 s of training: room to kill a run between its first checkpoint and end
# Tiny and deterministic; a checkpoint every 5 steps, so a killed run has one to resume.
TRAIN: dict[str, Any] = {
    "steps": STEPS,
    "seed": 7,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 0},
    "checkpoint": {"every": 5, "keep": 2},
    "log_every": 1,
}
ENDLESS = {**TRAIN, "steps": 100_000, "checkpoint": {"every": 0, "keep": 1}}
# Decoupled weight decay at lr 10 multiplies the weights by -99 a step: fp32 overflows in a
# few steps (the same divergence as tests/trainer/test_failures.py).
DIVERGES = {
    **TRAIN,
    "optim": {"lr": 10.0, "weight_decay": 10.0, "grad_clip": 0.0, "warmup_steps": 0},
    "checkpoint": {"every": 0, "keep": 1},
}
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


@dataclass
class Cluster:
    """The module's running system: the API (auth on) and the workers serving QUEUE."""

    system: System
    api: Api
    workers: dict[str, Proc] = field(default_factory=dict)

    @property
    def runs_root(self) -> Path:
        return Path(self.system.env["TRAINQ_RUNS_ROOT"])

    @property
    def data_root(self) -> Path:
        return Path(self.system.env["TRAINQ_DATA_ROOT"])

    def start_worker(self, queue: str = QUEUE) -> str:
        name = f"e2e-{uuid.uuid4().hex[:6]}"
        self.workers[name] = self.system.start_worker(queue, name=name)
        return name

    def submit(self, name: str, train: dict[str, Any], **spec: Any) -> str:
        body = {"name": name, "queue": QUEUE, "procs_per_node": 2, "train": train, **spec}
        with self.api.client() as client:
            r = client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def get(self, job_id: str, what: str = "", **params: Any) -> httpx.Response:
        with self.api.client() as client:
            r = client.get(f"/v1/jobs/{job_id}{what}", params=params)
        assert r.status_code == 200, r.text
        return r

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(job_id).json())

    def wait_job(self, job_id: str, statuses: tuple[str, ...], timeout: float) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["status"] in statuses else None

        try:
            return dict(wait_for(settled, timeout, f"job {job_id} to be {statuses}", every=0.2))
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {self.job(job_id)}\n{self.tails()}") from None

    def metrics(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(job_id, "/metrics", max_points=100_000).json())

    def logs(self, job_id: str, **params: Any) -> str:
        return self.get(job_id, "/logs", **params).text

    def processes(self, job_id: str) -> list[int]:
        return run_processes(job_id, self.runs_root / job_id)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.system.procs)


@pytest.fixture(scope="module")
def cluster(fast_system: System) -> Cluster:
    api = fast_system.start_api(auth=True)
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], "e2e-user")
    with httpx.Client(base_url=api.url) as anonymous:
        assert anonymous.get("/v1/jobs").status_code == 401, "auth is on: no token, no jobs"
    c = Cluster(fast_system, api)
    for _ in range(3):
        c.start_worker()
    return c


@pytest.fixture(scope="module")
def failure_jobs(cluster: Cluster) -> dict[str, str]:
    """Jobs that end in a failure of their own, submitted at once (one rank each)."""
    folder = cluster.data_root / "corrupt"
    folder.mkdir()
    for split in ("train", "val"):
        (folder / f"{split}_000.bin").write_bytes(b"not a token shard" * 100)
    one = {"procs_per_node": 1}
    return {
        "deadline": cluster.submit("e2e-deadline", ENDLESS, max_runtime_s=4, retries=1, **one),
        "nan": cluster.submit("e2e-nan", DIVERGES, retries=2, **one),
        "corrupt": cluster.submit(
            "e2e-corrupt", {**TRAIN, "data": {"path": "corrupt"}}, retries=1, **one
        ),
    }


def statuses(events: list[SseEvent]) -> list[str]:
    return [e.data["status"] for e in events if e.event == "status"]


def losses(metrics: dict[str, Any]) -> dict[int, float]:
    return {p["step"]: p["loss"] for p in metrics["points"]}


@dataclass
class Reference:
    """An uninterrupted run of TRAIN, followed live from submit to its end."""

    job_id: str
    at_open: dict[str, Any]  # the job and its metric count the moment the stream opened
    events: list[SseEvent]
    job: dict[str, Any]
    metrics: dict[str, Any]
    logs: str


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> Reference:
    job_id = cluster.submit("e2e-ref", TRAIN)
    follower = SseFollower(cluster.api, job_id).start()
    at_open = {"job": cluster.job(job_id), "metrics": cluster.metrics(job_id)["total"]}
    events = follower.wait_closed(90)
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 10)
    return Reference(job_id, at_open, events, job, cluster.metrics(job_id), cluster.logs(job_id))


# failure_jobs: submitted first, so they run while this test waits on its job.
@pytest.mark.usefixtures("failure_jobs")
def test_submit_runs_two_ranks_to_success_with_metrics_live_and_in_sql(
    reference: Reference,
) -> None:
    job, events = reference.job, reference.events
    assert job["status"] == "succeeded", job
    assert job["reason"] is None and job["attempt"] == 1 and job["retries_used"] == 0
    [attempt] = job["attempts"]
    assert attempt["status"] == "exited" and attempt["exit_code"] == 0
    assert attempt["worker"].startswith("e2e-") and attempt["host"]
    assert job["latest"]["step"] == STEPS
    assert "ddp x2" in reference.logs, "torchrun ran 2 ranks"
    assert "FutureWarning" not in reference.logs, "a deprecated call printed by every rank"
    assert all(ln.startswith("[a1 ") for ln in reference.logs.splitlines()), reference.logs

    # The stream was open before the first step was trained: every metric came live.
    assert reference.at_open["job"]["status"] in ("queued", "running")
    assert reference.at_open["metrics"] == 0

    # Live: each step once, in order, before the terminal status, which is the last event.
    metric_at = [i for i, e in enumerate(events) if e.event == "metric"]
    live_steps = [events[i].data["step"] for i in metric_at]
    assert live_steps == list(range(1, STEPS + 1))
    assert {events[i].data["attempt"] for i in metric_at} == {1}
    terminal = [i for i, e in enumerate(events) if e.event == "status"][-1]
    assert events[terminal].data["status"] == "succeeded"
    assert terminal == len(events) - 1, "the stream closes after the terminal status"
    assert max(metric_at) < terminal
    running = next(
        i for i, e in enumerate(events) if e.event == "lifecycle" and e.data["phase"] == "running"
    )
    assert running < min(metric_at)
    assert statuses(events)[-2:] == ["running", "succeeded"]
    # ... and received while the job was still running, not replayed after it ended.
    ended = _unix(job["ended_at"])
    assert events[metric_at[0]].at < ended

    # In SQL: every step, with exactly the values that were streamed.
    metrics = reference.metrics
    assert metrics["total"] == STEPS and not metrics["downsampled"]
    assert [p["step"] for p in metrics["points"]] == list(range(1, STEPS + 1))
    assert {p["attempt"] for p in metrics["points"]} == {1}
    streamed = {events[i].data["step"]: events[i].data["loss"] for i in metric_at}
    assert losses(metrics) == streamed
    assert all(math.isfinite(v) for v in streamed.values())
    assert losses(metrics)[STEPS] < losses(metrics)[1], "it trained"


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_cancel_mid_run_leaves_no_process(cluster: Cluster) -> None:
    job_id = cluster.submit("e2e-cancel", ENDLESS)
    follower = SseFollower(cluster.api, job_id).start()
    wait_for(lambda: cluster.metrics(job_id)["total"] >= 3, 60, "training to start", every=0.2)
    running = cluster.processes(job_id)
    assert len(running) >= 4, f"guard, torchrun and 2 ranks, found {running}"

    with cluster.api.client() as client:
        r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelling"
    job = cluster.wait_job(job_id, ("cancelled", "failed", "succeeded"), 30)
    # The worker reports the exit only once the group is gone: nothing is left at this point.
    assert cluster.processes(job_id) == []
    assert (job["status"], job["reason"]) == ("cancelled", "cancelled"), job
    assert [a["status"] for a in job["attempts"]] == ["exited"]
    assert statuses(follower.wait_closed(30))[-3:] == ["running", "cancelling", "cancelled"]
    # Its log ends with one line that says so, not torchrun's traceback of the SIGTERM.
    logs = cluster.logs(job_id)
    for noise in ("Traceback", "SignalException", "preempt"):
        assert noise not in logs, logs[-3000:]
    said = [ln for ln in logs.splitlines() if "cancelled" in ln]
    assert len(said) == 1 and said[0] == logs.splitlines()[-1], logs[-3000:]
    assert re.fullmatch(
        r"\[a1 worker stderr\] trainq: cancelled by the user; stopped at step \d+ "
        r"\(checkpoint saved\)",
        said[0],
    ), said


def test_worker_killed_mid_run_is_retried_elsewhere_and_resumes_exactly(
    cluster: Cluster, reference: Reference
) -> None:
    import redis

    job_id = cluster.submit("e2e-kill", TRAIN, retries=1)
    run_dir = cluster.runs_root / job_id

    def running_on() -> str | None:
        job = cluster.job(job_id)
        return job["attempts"][0]["worker"] if job["status"] == "running" else None

    first = wait_for(running_on, 60, "attempt 1 to run", every=0.1)
    checkpoints = run_dir / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*/DONE")), 60, "a checkpoint", every=0.02)
    os.kill(cluster.workers[first].popen.pid, signal.SIGKILL)

    # The run dies with its worker; the heartbeat expires (it is not deleted) a few s later.
    wait_for(lambda: not cluster.processes(job_id), 10, "the run's processes to die")
    events = redis.Redis.from_url(cluster.system.redis_url)
    hb = f"{cluster.system.prefix}:hb:{job_id}:1"
    wait_for(lambda: not events.exists(hb), 10, "the heartbeat of attempt 1 to expire", 0.05)
    events.close()
    assert cluster.job(job_id)["attempts"][0]["status"] == "running", "not reaped early"

    # Within 30 s of the expiry: attempt 1 lost, attempt 2 running on the other worker.
    def retried() -> dict[str, Any] | None:
        job = cluster.job(job_id)
        if job["status"] == "running" and job["attempt"] == 2:
            return job
        assert job["status"] in ("running", "queued"), job  # never failed or stuck
        return None

    job = wait_for(retried, 30, "attempt 2 to run", every=0.1)
    cluster.workers.pop(first)
    lost, second = job["attempts"]
    assert (lost["status"], lost["reason"]) == ("lost", "lost"), lost
    assert second["worker"] != first and second["worker"] in cluster.workers
    cluster.start_worker()  # the module keeps two workers

    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 60)
    assert job["status"] == "succeeded", job
    assert [a["status"] for a in job["attempts"]] == ["lost", "exited"]
    assert job["retries_used"] == 1

    # Attempt 2 resumed from attempt 1's checkpoint ...
    resumed = RESUMED.search(cluster.logs(job_id, attempt=2))
    assert resumed, cluster.logs(job_id, attempt=2)
    # One log of both attempts, each line tagged with its own.
    both = cluster.logs(job_id).splitlines()
    assert both == [
        *cluster.logs(job_id, attempt=1).splitlines(),
        *cluster.logs(job_id, attempt=2).splitlines(),
    ]
    # Attempt 1's own lines may have died with its SIGKILLed worker before being forwarded;
    # whatever of them arrived comes first and says a1.
    tags = [ln.split(" ", 1)[0] for ln in both]
    assert tags == sorted(tags) and set(tags) <= {"[a1", "[a2"} and "[a2" in tags, both
    assert any(ln.startswith("[a2 rank 0] resumed from") for ln in both), both
    step = int(resumed.group(2))
    assert 5 <= step < STEPS and step % 5 == 0
    assert Path(resumed.group(1)).parent == run_dir.resolve() / "checkpoints"
    metrics = cluster.metrics(job_id)
    by_attempt = {p["step"]: p["attempt"] for p in metrics["points"]}
    assert by_attempt == {s: 1 if s <= step else 2 for s in range(1, STEPS + 1)}
    # ... and every step's loss is the uninterrupted run's.
    mine, straight = losses(metrics), losses(reference.metrics)
    assert sorted(mine) == sorted(straight) == list(range(1, STEPS + 1))
    worst = max(abs(mine[s] - straight[s]) for s in mine)
    assert worst <= 1e-6, {s: (mine[s], straight[s]) for s in mine if mine[s] != straight[s]}


def test_deadline_fails_with_timeout(cluster: Cluster, failure_jobs: dict[str, str]) -> None:
    job_id = failure_jobs["deadline"]
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 60)
    assert cluster.processes(job_id) == []
    assert (job["status"], job["reason"]) == ("failed", "timeout"), job
    assert "max_runtime_s=4" in job["message"], job["message"]
    [attempt] = job["attempts"]  # a timeout is not retried: it would only time out again
    assert attempt["started_at"] is not None and attempt["reason"] == "timeout"


def test_diverging_run_fails_with_nan_loss(cluster: Cluster, failure_jobs: dict[str, str]) -> None:
    job_id = failure_jobs["nan"]
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 60)
    assert (job["status"], job["reason"]) == ("failed", "nan_loss"), job
    assert re.search(r"loss is (nan|inf) at step \d+", job["message"]), job["message"]
    assert len(job["attempts"]) == 1, "nan_loss is not retried: it would only diverge again"
    assert cluster.processes(job_id) == []


def test_corrupt_shard_fails_with_spec_error(
    cluster: Cluster, failure_jobs: dict[str, str]
) -> None:
    job_id = failure_jobs["corrupt"]
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 60)
    assert (job["status"], job["reason"]) == ("failed", "spec_error"), job
    assert "magic number" in job["message"] and "train_000.bin" in job["message"], job
    assert len(job["attempts"]) == 1, "a spec error is not retried"
    assert cluster.processes(job_id) == []


@pytest.fixture()
def late_worker(cluster: Cluster) -> Iterator[Any]:
    started: list[str] = []

    def start() -> str:
        started.append(cluster.start_worker(LATE_QUEUE))
        return started[-1]

    yield start
    for name in started:
        cluster.workers.pop(name).stop()


def test_data_removed_before_the_worker_starts_fails_with_spec_error(
    cluster: Cluster, late_worker: Any
) -> None:
    folder = cluster.data_root / "vanishing"
    shutil.copytree(cluster.data_root / "demo", folder)
    job_id = cluster.submit(
        "e2e-vanish", {**TRAIN, "data": {"path": "vanishing"}}, queue=LATE_QUEUE
    )
    queued = cluster.job(job_id)
    assert queued["status"] == "queued"
    assert queued["pending_reason"] == f"no worker serves queue {LATE_QUEUE}"
    shutil.rmtree(folder)
    name = late_worker()
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 30)
    assert (job["status"], job["reason"]) == ("failed", "spec_error"), job
    assert "'vanishing'" in job["message"] and name in job["message"], job["message"]
    assert cluster.processes(job_id) == []


# kombu's own bookkeeping in the broker database, and Celery's default names: a spec's queue
# must not be able to name any of them.
BROKER_NAMES = ("unacked_index", "unacked", "unacked_mutex", "celery", "celeryev")


def test_a_queue_named_like_the_brokers_own_keys_harms_no_worker(cluster: Cluster) -> None:
    import redis

    hostile = {  # accepted, and wait in SQL for a worker that serves them
        name: cluster.submit(f"e2e-hostile-{name}", TRAIN, queue=name, procs_per_node=1)
        for name in BROKER_NAMES
    }
    job_id = cluster.submit("e2e-after-hostile", {**TRAIN, "steps": 3}, procs_per_node=1)
    job = cluster.wait_job(job_id, ("succeeded", "failed", "cancelled"), 60)
    assert job["status"] == "succeeded", job
    dead = [name for name, proc in cluster.workers.items() if not proc.alive()]
    assert dead == [], f"workers died: {dead}\n{cluster.tails()}"
    broker = redis.Redis.from_url(cluster.system.env["TRAINQ_BROKER_URL"])
    try:
        # kombu's keys keep the types kombu gives them; the hostile queues live under the prefix.
        assert broker.type("unacked_index") in (b"zset", b"none")
        assert broker.type("unacked") in (b"hash", b"none")
        for name, hostile_id in hostile.items():
            # The admitter sends only to a worker it chose: nothing reaches the broker.
            assert broker.llen(f"trainq.{name}") == 0, name
            job = cluster.job(hostile_id)
            assert (job["status"], job["pending_reason"]) == (
                "queued",
                f"no worker serves queue {name}",
            ), job
    finally:
        broker.close()
