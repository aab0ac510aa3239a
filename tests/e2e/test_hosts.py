"""Workers on separate network hosts: Linux network namespaces on a bridge (tests/hosts.py).

One system for the module: PostgreSQL, Redis and the API in the root namespace, three hosts
each running ``python -m worker`` in its own namespace (one slot), reaching Redis through
their own relay on the bridge, sharing one folder as data and runs roots. Nothing tells a
worker its address: each advertises the one its route to the broker picks (worker.address).

The faults are those of a real cluster: a host lost (every process in it killed, its link
down), a host cut off but alive (link down, then back: its old attempt is fenced), and Redis
unreachable from one host only. Each scenario brings the hosts back for the next one.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import redis

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import Proc, System, build_system, create_token, wait_for
from tests.e2e.test_system import TRAIN, Cluster, losses
from tests.hosts import Host, Hosts, available

pytestmark = pytest.mark.timeout(300)

QUEUE = "e2e-hosts"
DONE = ("succeeded", "failed", "cancelled")
# Long enough to lose a host between its first checkpoint and its end.
STEPS = 40
JOB = {**TRAIN, "steps": STEPS, "checkpoint": {"every": 5, "keep": 2}}
SETTINGS = {
    **FAST_SETTINGS,
    "TRAINQ_GANG_TIMEOUT_S": "30",
    "TRAINQ_WORKER_STALE_S": "4",  # the API: a registry entry this old is a worker gone
}


class HostCluster(Cluster):
    hosts: Hosts
    on: dict[str, Host]  # worker name -> its host

    def start_host_worker(self, host: Host) -> str:
        """``python -m worker`` inside ``host``, reaching Redis at its relay."""
        name = f"w-{host.netns}"
        env = {k: v for k, v in self.system.env.items() if k != "TRAINQ_DATABASE_URL"}
        for var in ("TRAINQ_REDIS_URL", "TRAINQ_BROKER_URL"):
            env[var] = self.hosts.redis_url(host, int(env[var].rsplit("/", 1)[1]))
        argv = [sys.executable, "-m", "worker", "--queues", QUEUE, "--slots", "1"]
        log = self.system.log_dir / f"{name}.log"
        proc = Proc(name, host.popen([*argv, "--hostname", name], env, log), log)
        self.system.procs.append(proc)
        self.workers[name], self.on[name] = proc, host
        wait_for(lambda: self.registered(name, proc), 60, f"worker {name} to register", 0.2)
        return name

    def registered(self, name: str, proc: Proc | None = None) -> bool:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"worker {name} exited early:\n{proc.tail()}")
        with self.api.client() as client:
            listed = client.get("/v1/workers").json()["items"]
        return any(w["name"] == name for w in listed)

    def lifecycle(self, job_id: str, attempt: int) -> list[dict[str, Any]]:
        r = redis.Redis.from_url(self.system.redis_url)
        try:
            entries = r.xrange(f"{self.system.prefix}:job:{job_id}")
        finally:
            r.close()
        return [
            json.loads(f[b"data"])
            for _, f in entries
            if f[b"kind"] == b"lifecycle" and int(f[b"attempt"]) == attempt
        ]

    def placed(self, job_id: str, attempt: int, nodes: int) -> dict[int, str]:
        """node -> worker name, once every node of the attempt runs."""

        def running() -> dict[int, str] | None:
            found = {
                int(e.get("node", 0)): e["worker"]
                for e in self.lifecycle(job_id, attempt)
                if e["phase"] == "running"
            }
            return found if len(found) == nodes else None

        return dict(wait_for(running, 120, f"{job_id}:{attempt} to run", every=0.1))

    def revive(self, host: Host) -> None:
        """Link up, relay on, and a worker in it again (a host back after a fault)."""
        host.link(True)
        assert host.relay is not None
        host.relay.resume()
        for name in [n for n, h in self.on.items() if h is host]:
            proc = self.workers.pop(name)
            self.on.pop(name)
            if proc.alive():
                proc.stop()
        self.start_host_worker(host)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = available()
    if why is not None:
        pytest.skip(why)
    made = Hosts(3)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def cluster(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    hosts: Hosts,
) -> Iterator[HostCluster]:
    env = {k: v for k, v in subprocess_env.items() if k != "TRAINQ_ADVERTISE_HOST"}
    root = tmp_path_factory.mktemp("hosts")
    system: System = build_system(root, pg_url, redis_dbs, env, SETTINGS)
    try:
        api = system.start_api(auth=True)
        api.token = create_token(system.env["TRAINQ_DATABASE_URL"], "hosts-user")
        c = HostCluster(system, api)
        c.hosts, c.on = hosts, {}
        for host in hosts.hosts:
            c.start_host_worker(host)
        yield c
    finally:
        system.stop()


def submit(c: HostCluster, name: str, nodes: int, procs: int, **spec: Any) -> str:
    return c.submit(name, JOB, queue=QUEUE, nodes=nodes, procs_per_node=procs, **spec)


@pytest.fixture(scope="module")
def one_host(cluster: HostCluster) -> dict[int, float]:
    """The per-step losses of JOB as 1 node x 4 ranks: every rank on one host."""
    job_id = submit(cluster, "hosts-1x4", 1, 4)
    job = cluster.wait_job(job_id, DONE, 150)
    assert job["status"] == "succeeded", job
    return losses(cluster.metrics(job_id))


def _attempts_ended(cluster: HostCluster, job_id: str, n: int) -> dict[str, Any] | None:
    job = cluster.job(job_id)
    return job if len(job["attempts"]) >= n and job["attempts"][n - 1]["ended_at"] else None


def _endpoint_host(cluster: HostCluster, job_id: str, attempt: int) -> str:
    r = redis.Redis.from_url(cluster.system.redis_url, decode_responses=True)
    try:
        endpoint = r.hget(f"{cluster.system.prefix}:gang:{job_id}:{attempt}", "endpoint")
    finally:
        r.close()
    assert endpoint is not None
    return str(endpoint).rsplit(":", 1)[0]


def test_two_hosts_train_like_one_and_a_host_lost_mid_run_resumes_exactly_elsewhere(
    cluster: HostCluster, one_host: dict[int, float]
) -> None:
    """A 2-node x 2-rank job across two hosts: its steps are the one-host job's, bit for bit;
    then node 1's host is lost (every process killed, link down): the attempt ends within
    the heartbeat's TTL + grace, and the job resumes on the two other hosts, every loss
    within 1e-6 of the uninterrupted one-host run."""
    job_id = submit(cluster, "hosts-2x2", 2, 2, retries=1)
    placed = cluster.placed(job_id, 1, 2)
    host0, victim = cluster.on[placed[0]], cluster.on[placed[1]]
    assert host0 is not victim, "one node on each host"
    # Node 0 advertised its own address on the bridge (its route to the broker): the other
    # host reached its rendezvous store there, not at a loopback address or a host name.
    assert _endpoint_host(cluster, job_id, 1) == host0.address
    checkpoints = cluster.runs_root / job_id / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*/DONE")), 120, "a checkpoint", every=0.02)
    lost_at = time.time()
    assert victim.kill_all() > 0
    victim.link(False)
    try:
        job = wait_for(lambda: _attempts_ended(cluster, job_id, 1), 60, "attempt 1 to end")
        first = job["attempts"][0]
        took = datetime.fromisoformat(first["ended_at"]).timestamp() - lost_at
        ttl = sum(
            float(SETTINGS[k]) for k in ("TRAINQ_HEARTBEAT_TTL_S", "TRAINQ_HEARTBEAT_GRACE_S")
        )
        print(f"\nhost lost -> attempt 1 {first['reason']} after {took:.1f} s (ttl+grace {ttl:g})")
        # Ended by the victim's heartbeat expiring (lost), or sooner by the surviving node's
        # ranks failing on their vanished peers (exit_code); never by a collective's timeout.
        assert first["reason"] in ("lost", "exit_code"), first
        assert took <= ttl + 5, "the heartbeat expiry or the peers' failure ended it"
        second = cluster.placed(job_id, 2, 2)
        assert victim not in {cluster.on[w] for w in second.values()}
        assert _endpoint_host(cluster, job_id, 2) == cluster.on[second[0]].address
        job = cluster.wait_job(job_id, DONE, 150)
    finally:
        cluster.revive(victim)
    assert job["status"] == "succeeded", job
    assert "resumed from" in cluster.logs(job_id, attempt=2)
    points = cluster.metrics(job_id)["points"]
    across = {p["step"]: p["loss"] for p in points if p["attempt"] == 1}
    assert len(across) >= 5, "attempt 1 ran to its first checkpoint at least"
    differ = {s: (across[s], one_host[s]) for s in across if across[s] != one_host[s]}
    print(f"2 hosts x 2 ranks vs 1 host x 4 ranks, {len(across)} steps: {len(differ)} differ")
    assert differ == {}
    mine = losses(cluster.metrics(job_id))
    assert sorted(mine) == sorted(one_host) == list(range(1, STEPS + 1))
    worst = max(abs(mine[s] - one_host[s]) for s in mine)
    assert worst <= 1e-6, {s: (mine[s], one_host[s]) for s in mine}
    assert cluster.processes(job_id) == []


def _ours(cluster: HostCluster, host: Host) -> list[int]:
    """Processes in ``host`` other than its workers: the ranks, torchrun and guards."""
    workers = {p.popen.pid for n, p in cluster.workers.items() if cluster.on[n] is host}
    return [pid for pid in host.pids() if pid not in workers]


def _fault_then_retry(
    cluster: HostCluster, name: str, fault: str
) -> tuple[str, Host, dict[str, Any]]:
    """A job of 2 nodes x 1 rank; once it has a checkpoint, ``fault`` hits node 1's host
    ("link": cut off, alive; "redis": only Redis unreachable from it). Returns once the
    service has called attempt 1 lost and attempt 2 runs on the other hosts; the host is
    still cut off then."""
    job_id = submit(cluster, name, 2, 1, retries=1)
    placed = cluster.placed(job_id, 1, 2)
    checkpoints = cluster.runs_root / job_id / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*/DONE")), 120, "a checkpoint", every=0.02)
    host = cluster.on[placed[1]]
    assert host.relay is not None
    host.link(False) if fault == "link" else host.relay.cut()
    job = wait_for(lambda: _attempts_ended(cluster, job_id, 1), 60, "attempt 1 to end")
    assert job["attempts"][0]["reason"] == "lost", job
    second = cluster.placed(job_id, 2, 2)
    assert host not in {cluster.on[w] for w in second.values()}
    return job_id, host, job


def _late_exit(cluster: HostCluster, job_id: str) -> dict[str, Any]:
    """Node 1's exit of attempt 1, sent by the cut host's worker once it reaches Redis."""

    def sent() -> dict[str, Any] | None:
        exits = cluster.lifecycle(job_id, 1)
        return next((e for e in exits if e["phase"] == "exited" and e["node"] == 1), None)

    return dict(wait_for(sent, 60, "the cut host's late exit", every=0.2))


def test_a_host_cut_off_alive_is_fenced_and_what_it_sends_later_is_dropped(
    cluster: HostCluster,
) -> None:
    job_id, host, job = _fault_then_retry(cluster, "hosts-cut", "link")
    lost_at = datetime.fromisoformat(job["attempts"][0]["ended_at"]).timestamp()
    done = cluster.wait_job(job_id, DONE, 150)
    assert done["status"] == "succeeded" and done["attempt"] == 2, done
    assert _ours(cluster, host), "cut off, its node of attempt 1 still runs"
    host.link(True)
    # Back, its node stops at once, by whichever word reaches it first: the job's fence
    # raised by attempt 2 (lost), the service's stop of the old attempt (cancelled), or its
    # ranks failing on their peer, long gone (exit_code).
    wait_for(lambda: not _ours(cluster, host), 60, "the cut host's old node to stop", 0.2)
    late = _late_exit(cluster, job_id)
    print(f"\ncut-off node's exit: {late['reason']}: {late['message'][:160]}")
    assert late["reason"] in ("lost", "cancelled", "exit_code"), late
    assert cluster.job(job_id)["status"] == "succeeded", "a late exit changes nothing"
    # Nothing attempt 1 sent after the service called it lost was stored.
    points = cluster.metrics(job_id)["points"]
    assert [p for p in points if p["attempt"] == 1 and p["ts"] > lost_at] == []
    cluster.revive(host)


def test_redis_unreachable_from_one_host_stops_its_worker_and_the_job_runs_elsewhere(
    cluster: HostCluster,
) -> None:
    job_id, host, _ = _fault_then_retry(cluster, "hosts-redis", "redis")
    name = next(n for n, h in cluster.on.items() if h is host)
    stale = float(SETTINGS["TRAINQ_WORKER_STALE_S"])
    wait_for(lambda: not cluster.registered(name), stale + 10, f"{name} to leave the registry")
    assert "cannot reach Redis" in cluster.workers[name].tail(400)
    # Its node's peer was stopped by the service: not left half-running.
    wait_for(lambda: not _ours(cluster, host), 60, "the cut host's node to end", 0.2)
    done = cluster.wait_job(job_id, DONE, 150)
    assert done["status"] == "succeeded" and done["attempt"] == 2, done
    assert host.relay is not None
    host.relay.resume()
    wait_for(lambda: cluster.registered(name), 30, f"{name} back in the registry", every=0.2)
    assert cluster.processes(job_id) == []
