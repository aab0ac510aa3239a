"""A worker host cut off for a while, then back, takes work again within a bound.

One namespace host (tests/hosts.py) runs ``python -m worker``, the only worker of this
system (one slot); PostgreSQL, Redis and the API are in the root namespace. The host's link
goes down, its worker alive, until the service counts the worker gone (its registry entry
stale) and, if it ran an attempt, calls that attempt lost (heartbeat TTL + grace). Then the
link comes back and the host's relay ends the connections it carried, as a Redis restart,
or a NAT that forgot them, would. Within ``BOUND_S`` of the link's return the worker must
be back in ``GET /v1/workers`` and run the job's next attempt, or a new job: it is the only
worker of the queue, so nothing else can.

1. Busy when cut: its attempt, called lost, must stop once Redis answers again (the
   service's stop key, worker.supervise), or it holds the slot that the job's next attempt
   waits for, for as long as the run would have lasted (here: forever).
2. Idle when cut: its broker connection comes back with it, and a new job runs and succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.system import wait_for
from tests.e2e.test_hosts import QUEUE, SETTINGS, TTL_GRACE, HostCluster, host_cluster
from tests.e2e.test_system import ENDLESS, TRAIN
from tests.hosts import Host

pytestmark = pytest.mark.timeout(300)

STALE_S = float(SETTINGS["TRAINQ_WORKER_STALE_S"])
BOUND_S = 30.0  # link back -> back in the registry, and -> a job running on the host
DONE = ("succeeded", "failed", "cancelled")
SHORT = {**TRAIN, "steps": 3, "checkpoint": {"every": 0, "keep": 1}}


@pytest.fixture(scope="module")
def cluster(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[HostCluster]:
    root = tmp_path_factory.mktemp("heal")
    with host_cluster(pg_url, redis_dbs, subprocess_env, root, 1, "heal-user") as c:
        yield c


def _the_worker(cluster: HostCluster) -> tuple[str, Host]:
    (name,) = cluster.workers
    return name, cluster.on[name]


def _started(cluster: HostCluster, job_id: str, n: int) -> bool:
    attempts = cluster.job(job_id)["attempts"]
    return len(attempts) >= n and attempts[n - 1]["started_at"] is not None


def _back(cluster: HostCluster, host: Host) -> float:
    """Link up, the relay's connections ended; when (monotonic)."""
    assert host.relay is not None
    host.link(True)
    host.relay.reset()
    return time.monotonic()


def _within(cluster: HostCluster, back: float, predicate: Any, what: str) -> float:
    """Seconds from ``back`` until ``predicate()``; fails past ``BOUND_S`` with the logs."""
    try:
        wait_for(predicate, max(0.5, back + BOUND_S - time.monotonic()), what, 0.1)
    except TimeoutError as exc:
        raise AssertionError(f"{exc} (link back {BOUND_S:g} s ago)\n{cluster.tails()}") from None
    return time.monotonic() - back


def test_a_host_cut_off_while_running_stops_its_lost_attempt_and_runs_the_next(
    cluster: HostCluster,
) -> None:
    name, host = _the_worker(cluster)
    job_id = cluster.submit("heal-busy", ENDLESS, queue=QUEUE, procs_per_node=1, retries=1)
    wait_for(lambda: _started(cluster, job_id, 1), 120, "attempt 1 to run", 0.1)
    host.link(False)
    wait_for(
        lambda: len(cluster.job(job_id)["attempts"]) == 2,
        TTL_GRACE + 30,
        "attempt 1 lost and attempt 2 made",
        0.1,
    )
    assert cluster.job(job_id)["attempts"][0]["reason"] == "lost"
    wait_for(lambda: not cluster.registered(name), STALE_S + 30, f"{name} to leave the registry")
    back = _back(cluster, host)
    registered = _within(cluster, back, lambda: cluster.registered(name), "back in the registry")
    running = _within(cluster, back, lambda: _started(cluster, job_id, 2), "attempt 2 to run")
    print(
        f"\nbusy when cut: link back -> registered {registered:.1f} s, next attempt running"
        f" {running:.1f} s"
    )
    job = cluster.job(job_id)
    assert job["attempts"][1]["worker"] == name, job
    assert "its heartbeat expired" in cluster.workers[name].tail(400)
    with cluster.api.client() as client:
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    assert cluster.wait_job(job_id, DONE, 60)["status"] == "cancelled"


def test_a_host_cut_off_while_idle_runs_a_new_job(cluster: HostCluster) -> None:
    name, host = _the_worker(cluster)
    wait_for(lambda: cluster.registered(name), 30, f"{name} registered")
    host.link(False)
    cut = time.monotonic()
    wait_for(lambda: not cluster.registered(name), STALE_S + 30, f"{name} to leave the registry")
    time.sleep(max(0.0, cut + TTL_GRACE + 1 - time.monotonic()))
    back = _back(cluster, host)
    job_id = cluster.submit("heal-idle", SHORT, queue=QUEUE, procs_per_node=1)
    registered = _within(cluster, back, lambda: cluster.registered(name), "back in the registry")
    running = _within(cluster, back, lambda: _started(cluster, job_id, 1), "the job to run")
    print(
        f"\nidle when cut: link back -> registered {registered:.1f} s, job running {running:.1f} s"
    )
    done = cluster.wait_job(job_id, DONE, 120)
    assert done["status"] == "succeeded", done
    assert done["attempts"][0]["worker"] == name
