"""Multi-node jobs end to end: gang-launched over HTTP onto two real workers, or not at all.

A system of its own (the fast settings of conftest.py, and a 10 s gang timeout) with two
Celery workers of one slot serving QUEUE, so a job of 2 nodes runs one node on each, and a
job of 3 nodes is never admitted (service.api.scheduling.admit places a gang whole or not at all); a
gang placed on a worker that takes nothing (stopped) times out and is requeued. Each node's
torchrun runs 1 rank (gloo, CPU, loopback rendezvous); what the tests assert is read through
the API, the job's event stream and the process table.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import redis

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import System, build_system, create_token, wait_for
from tests.e2e.test_system import ENDLESS, TRAIN, Cluster, losses

pytestmark = pytest.mark.timeout(240)

QUEUE = "e2e-nodes"
GANG_TIMEOUT_S = 10
DONE = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def nodes_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    settings = {
        **FAST_SETTINGS,
        "TRAINQ_GANG_TIMEOUT_S": str(GANG_TIMEOUT_S),
        "TRAINQ_ADVERTISE_HOST": "127.0.0.1",  # node 0's rendezvous store, on loopback
    }
    system = build_system(
        tmp_path_factory.mktemp("nodes"), pg_url, redis_dbs, subprocess_env, settings
    )
    yield system
    system.stop()


@pytest.fixture(scope="module")
def cluster(nodes_system: System) -> Cluster:
    api = nodes_system.start_api(auth=True)
    api.token = create_token(nodes_system.env["TRAINQ_DATABASE_URL"], "nodes-user")
    c = Cluster(nodes_system, api)
    for _ in range(2):
        c.start_worker(QUEUE)
    return c


def submit(cluster: Cluster, name: str, train: dict[str, Any], **spec: Any) -> str:
    return cluster.submit(name, train, queue=QUEUE, **spec)


def lifecycle(cluster: Cluster, job_id: str, attempt: int = 1) -> list[dict[str, Any]]:
    """The worker's lifecycle events of one attempt, from the job's stream in Redis."""
    r = redis.Redis.from_url(cluster.system.redis_url)
    try:
        entries = r.xrange(f"{cluster.system.prefix}:job:{job_id}")
    finally:
        r.close()
    out = []
    for _, f in entries:
        if f[b"kind"] == b"lifecycle" and int(f[b"attempt"]) == attempt:
            out.append({**json.loads(f[b"data"]), "source": f[b"src"].decode()})
    return out


def node_exits(cluster: Cluster, job_id: str, nodes: int, timeout: float) -> dict[int, Any]:
    def all_exited() -> dict[int, Any] | None:
        found = {e["node"]: e for e in lifecycle(cluster, job_id) if e["phase"] == "exited"}
        return found if len(found) == nodes else None

    return dict(wait_for(all_exited, timeout, f"every node of {job_id} to exit", every=0.2))


@pytest.fixture(scope="module")
def single_node(cluster: Cluster) -> dict[int, float]:
    """The per-step losses of TRAIN run as 1 node x 2 procs."""
    job_id = submit(cluster, "nodes-1x2", TRAIN, nodes=1, procs_per_node=2)
    job = cluster.wait_job(job_id, DONE, 120)
    assert job["status"] == "succeeded", job
    return losses(cluster.metrics(job_id))


def test_two_nodes_of_one_rank_run_on_two_workers_and_train_like_one_node_of_two(
    cluster: Cluster, single_node: dict[int, float]
) -> None:
    gang = submit(cluster, "nodes-2x1", TRAIN, nodes=2, procs_per_node=1)
    job = cluster.wait_job(gang, DONE, 120)
    assert (job["status"], job["reason"]) == ("succeeded", None), job
    [attempt] = job["attempts"]
    assert attempt["status"] == "exited" and attempt["exit_code"] == 0
    running = {e["node"]: e["worker"] for e in lifecycle(cluster, gang) if e["phase"] == "running"}
    assert sorted(running) == [0, 1] and running[0] != running[1], "one node on each worker"
    assert set(running.values()) == set(cluster.workers)
    exits = node_exits(cluster, gang, 2, 10)
    assert {n: (e["exit_code"], e["reason"]) for n, e in exits.items()} == {
        0: (0, None),
        1: (0, None),
    }
    assert exits[1]["source"] == "worker:1" and exits[0]["source"] == "worker"
    logs = cluster.logs(gang)
    assert "[a1 node 0 rank 0] step 100/100" in logs, logs[-2000:]
    assert cluster.processes(gang) == []

    mine, straight = losses(cluster.metrics(gang)), single_node
    assert sorted(mine) == sorted(straight) == list(range(1, TRAIN["steps"] + 1))
    worst = max(abs(mine[s] - straight[s]) / abs(straight[s]) for s in straight)
    print(f"\n2 nodes x 1 proc vs 1 node x 2 procs, {len(mine)} steps: max rel diff {worst:.3g}")
    assert mine == straight, {s: (mine[s], straight[s]) for s in mine if mine[s] != straight[s]}


def test_a_gang_larger_than_its_queue_waits_and_starts_nothing(cluster: Cluster) -> None:
    job_id = submit(cluster, "nodes-3", TRAIN, nodes=3, procs_per_node=1)
    why = f"a gang of 3 nodes; queue {QUEUE} has 2 slot(s) on 2 worker(s)"
    job = wait_for(
        lambda: why in (cluster.job(job_id)["pending_reason"] or "") and cluster.job(job_id),
        10,
        "the admitter's reason",
        every=0.2,
    )
    assert job["status"] == "queued" and job["attempts"][0]["status"] == "dispatched", job
    assert lifecycle(cluster, job_id) == [], "no node was sent anywhere"
    with cluster.api.client() as client:
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"


def test_a_gang_that_cannot_gather_is_requeued_with_backoff_not_failed(cluster: Cluster) -> None:
    """The admitter's safety net: a worker that looks alive but takes nothing (stopped with
    SIGSTOP) gets a node; the other node's gang wait times out, and the job is requeued,
    held back, then runs once the worker is back, without spending a retry."""
    frozen = sorted(cluster.workers)[1]
    proc = cluster.workers[frozen]
    os.kill(proc.popen.pid, signal.SIGSTOP)
    try:
        job_id = submit(cluster, "nodes-stuck", TRAIN, nodes=2, procs_per_node=1)

        def requeued() -> dict[str, Any] | None:
            job = cluster.job(job_id)
            return job if job["attempt"] == 2 else None

        job = wait_for(requeued, GANG_TIMEOUT_S + 30, "the gang to give up", every=0.2)
    finally:
        os.kill(proc.popen.pid, signal.SIGCONT)
    assert job["status"] in ("queued", "running"), job
    assert job["reason"] == "no_worker" and job["retries_used"] == 0, job
    assert "its gang did not start (1 time(s)); requeued (no retry spent)" in job["message"], job
    assert f"gang of 2 nodes incomplete after {GANG_TIMEOUT_S} s" in job["message"], job
    done = cluster.wait_job(job_id, DONE, 120)
    assert (done["status"], done["retries_used"]) == ("succeeded", 0), done
    first, second = done["attempts"]
    assert (first["reason"], first["started_at"]) == ("no_worker", None), first
    assert second["exit_code"] == 0, second
    # Held back for the backoff (5 s) after the first attempt ended.
    gap = datetime.fromisoformat(second["started_at"]) - datetime.fromisoformat(first["ended_at"])
    assert gap.total_seconds() >= 4.5, gap
    assert cluster.processes(job_id) == []


def test_cancel_of_a_running_two_node_job_leaves_no_process_on_either_worker(
    cluster: Cluster,
) -> None:
    job_id = submit(cluster, "nodes-cancel", ENDLESS, nodes=2, procs_per_node=1)
    wait_for(lambda: cluster.metrics(job_id)["total"] >= 3, 90, "training to start", every=0.2)
    running = {
        e["node"]: e["worker"] for e in lifecycle(cluster, job_id) if e["phase"] == "running"
    }
    assert sorted(running) == [0, 1] and running[0] != running[1]
    assert len(cluster.processes(job_id)) >= 6, "guard, torchrun and a rank on each node"

    with cluster.api.client() as client:
        r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelling", r.text
    job = cluster.wait_job(job_id, DONE, 60)
    assert (job["status"], job["reason"]) == ("cancelled", "cancelled"), job
    # Each worker reports its node's exit only once its process group is gone.
    exits = node_exits(cluster, job_id, 2, 60)
    assert {e["reason"] for e in exits.values()} == {"cancelled"}
    assert cluster.processes(job_id) == []


def test_a_killed_node_worker_loses_the_attempt_and_the_retry_resumes_exactly(
    cluster: Cluster, single_node: dict[int, float]
) -> None:
    job_id = submit(cluster, "nodes-kill", TRAIN, nodes=2, procs_per_node=1, retries=1)
    checkpoints = cluster.runs_root / job_id / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*/DONE")), 90, "a checkpoint", every=0.02)
    running = {
        e["node"]: e["worker"] for e in lifecycle(cluster, job_id) if e["phase"] == "running"
    }
    victim = running[1]
    os.kill(cluster.workers[victim].popen.pid, signal.SIGKILL)
    cluster.workers.pop(victim)
    cluster.start_worker(QUEUE)  # a gang of 2 needs 2 workers again

    def retried() -> dict[str, Any] | None:
        job = cluster.job(job_id)
        assert job["status"] in ("running", "queued", "succeeded"), job
        return job if job["attempt"] == 2 else None

    wait_for(retried, 40, "attempt 2", every=0.1)
    job = cluster.wait_job(job_id, DONE, 120)
    assert job["status"] == "succeeded", job
    first, second = job["attempts"]
    # Node 1's heartbeat expired (lost), or node 0's rank failed first when its peer died.
    assert first["reason"] in ("lost", "exit_code"), first
    print(f"\nattempt 1 ended {first['reason']}: {first['message'][:200]}")
    assert second["status"] == "exited" and second["exit_code"] == 0
    assert cluster.processes(job_id) == []
    # Attempt 2 resumed from attempt 1's checkpoint, and every step's loss is the
    # uninterrupted single-node run's.
    assert "resumed from" in cluster.logs(job_id, attempt=2)
    mine = losses(cluster.metrics(job_id))
    assert sorted(mine) == sorted(single_node)
    worst = max(abs(mine[s] - single_node[s]) for s in mine)
    assert worst <= 1e-6, {s: (mine[s], single_node[s]) for s in mine}
