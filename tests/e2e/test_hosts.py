"""Workers on separate network hosts: Linux network namespaces on a bridge (tests/hosts.py).

One system for the module: PostgreSQL, Redis and the API in the root namespace, three hosts
each running ``python -m worker`` in its own namespace (one slot), reaching Redis through
their own relay on the bridge, sharing one folder as data and runs roots. Nothing tells a
worker its address: each advertises the one its route to the broker picks (worker.address).

The faults are those of a real cluster, dealt to one 2-node x 2-rank job in turn, each once
the attempt it hits has published a checkpoint of its own: a host lost (every process in it
killed, its link down), a host cut off but alive (link down, then back: its old attempt is
fenced), and Redis unreachable from one host only. One job carries them all because what
costs here is starting ranks, not training them: the job ends at its fourth attempt, every
step's loss that of the same job run uninterrupted on one host.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import Proc, System, build_system, create_token, wait_for
from tests.e2e.test_system import TRAIN, Cluster, losses
from tests.hosts import Host, Hosts, available

pytestmark = pytest.mark.timeout(600)  # one test, every fault: a loaded machine

QUEUE = "e2e-hosts"
DONE = ("succeeded", "failed", "cancelled")
# Room for three faults, each after a checkpoint of the attempt it hits (every 5 steps).
STEPS = 60
JOB = {**TRAIN, "steps": STEPS, "checkpoint": {"every": 5, "keep": 2}}
SETTINGS = {
    **FAST_SETTINGS,
    "TRAINQ_GANG_TIMEOUT_S": "30",
    "TRAINQ_WORKER_STALE_S": "4",  # the API: a registry entry this old is a worker gone
    # A stopped node whose ranks wait on a vanished peer cannot checkpoint on SIGTERM.
    "TRAINQ_CANCEL_GRACE_S": "2",
}
TTL_GRACE = sum(float(SETTINGS[k]) for k in ("TRAINQ_HEARTBEAT_TTL_S", "TRAINQ_HEARTBEAT_GRACE_S"))


class HostCluster(Cluster):
    hosts: Hosts
    on: dict[str, Host]  # worker name -> its host

    def start_host_worker(self, host: Host) -> str:
        """``python -m worker`` inside ``host``, reaching Redis at its relay; not waited for
        (``wait_registered``)."""
        name = f"w-{host.netns}"
        env = {k: v for k, v in self.system.env.items() if k != "TRAINQ_DATABASE_URL"}
        for var in ("TRAINQ_REDIS_URL", "TRAINQ_BROKER_URL"):
            env[var] = self.hosts.redis_url(host, int(env[var].rsplit("/", 1)[1]))
        argv = [sys.executable, "-m", "worker", "--queues", QUEUE, "--slots", "1"]
        log = self.system.log_dir / f"{name}.log"
        proc = Proc(name, host.popen([*argv, "--hostname", name], env, log), log)
        self.system.procs.append(proc)
        self.workers[name], self.on[name] = proc, host
        return name

    def wait_registered(self, name: str) -> None:
        proc = self.workers[name]
        wait_for(lambda: self.registered(name, proc), 60, f"worker {name} to register", 0.2)

    def worker_on(self, host: Host) -> str:
        return next(n for n, h in self.on.items() if h is host)

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

    def placed(self, job_id: str, attempt: int, nodes: int) -> dict[int, Host]:
        """node -> its host, once every node of the attempt runs."""

        def running() -> dict[int, str] | None:
            found = {
                int(e.get("node", 0)): e["worker"]
                for e in self.lifecycle(job_id, attempt)
                if e["phase"] == "running"
            }
            return found if len(found) == nodes else None

        names = wait_for(running, 120, f"{job_id}:{attempt} to run", every=0.1)
        return {node: self.on[name] for node, name in names.items()}

    def restart_worker(self, host: Host) -> str:
        """Link up, and its worker started again (a lost host back, with a fresh worker)."""
        host.link(True)
        name = self.worker_on(host)
        proc = self.workers.pop(name)
        self.on.pop(name)
        if proc.alive():
            proc.stop()
        return self.start_host_worker(host)


@contextmanager
def host_cluster(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    root: Path,
    count: int,
    user: str,
) -> Iterator[HostCluster]:
    """``count`` namespace hosts, a system (API in the root namespace) and a worker on each
    host, registered; all stopped and removed on exit. Skips where namespaces are denied."""
    why = available()
    if why is not None:
        pytest.skip(why)
    env = {k: v for k, v in subprocess_env.items() if k != "TRAINQ_ADVERTISE_HOST"}
    with Hosts(count) as hosts:
        system: System = build_system(root, pg_url, redis_dbs, env, SETTINGS)
        try:
            api = system.start_api(auth=True)
            api.token = create_token(system.env["TRAINQ_DATABASE_URL"], user)
            c = HostCluster(system, api)
            c.hosts, c.on = hosts, {}
            for name in [c.start_host_worker(host) for host in hosts.hosts]:  # start together
                c.wait_registered(name)
            yield c
        finally:
            system.stop()


@pytest.fixture(scope="module")
def cluster(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[HostCluster]:
    root = tmp_path_factory.mktemp("hosts")
    with host_cluster(pg_url, redis_dbs, subprocess_env, root, 3, "hosts-user") as c:
        yield c


def submit(c: HostCluster, name: str, nodes: int, procs: int, **spec: Any) -> str:
    return c.submit(name, JOB, queue=QUEUE, nodes=nodes, procs_per_node=procs, **spec)


def _ended(cluster: HostCluster, job_id: str, n: int) -> dict[str, Any]:
    """Attempt ``n`` of the job, once it has ended."""

    def ended() -> dict[str, Any] | None:
        attempts = cluster.job(job_id)["attempts"]
        return attempts[n - 1] if len(attempts) >= n and attempts[n - 1]["ended_at"] else None

    return dict(wait_for(ended, 60, f"attempt {n} to end"))


def _endpoint_host(cluster: HostCluster, job_id: str, attempt: int) -> str:
    r = redis.Redis.from_url(cluster.system.redis_url, decode_responses=True)
    try:
        endpoint = r.hget(f"{cluster.system.prefix}:gang:{job_id}:{attempt}", "endpoint")
    finally:
        r.close()
    assert endpoint is not None
    return str(endpoint).rsplit(":", 1)[0]


def _published(cluster: HostCluster, job_id: str) -> int:
    """The job's newest complete checkpoint step; 0 if none."""
    folder = cluster.runs_root / job_id / "checkpoints"
    return max((int(p.parent.name.split("-")[1]) for p in folder.glob("step-*/DONE")), default=0)


def _running(
    cluster: HostCluster, job_id: str, attempt: int, avoid: Host | None
) -> dict[int, Host]:
    """The attempt's hosts, once it runs: never ``avoid``, one node on each; rendezvous at
    node 0's host as it advertises itself (its route to the broker), not a loopback
    address or a host name."""
    placed = cluster.placed(job_id, attempt, 2)
    assert placed[0] is not placed[1], "one node on each host"
    assert avoid not in placed.values(), f"attempt {attempt} avoids the host at fault"
    assert _endpoint_host(cluster, job_id, attempt) == placed[0].address
    return placed


def _checkpointed(cluster: HostCluster, job_id: str, since: int) -> None:
    """Once the running attempt has published a checkpoint of its own: one after ``since``
    (the newest when it started, or later)."""
    wait_for(lambda: _published(cluster, job_id) > since, 120, "a new checkpoint", 0.02)


def _ours(cluster: HostCluster, host: Host) -> list[int]:
    """Processes in ``host`` other than its workers: the ranks, torchrun and guards."""
    workers = {p.popen.pid for n, p in cluster.workers.items() if cluster.on[n] is host}
    return [pid for pid in host.pids() if pid not in workers]


def _late_exit(cluster: HostCluster, job_id: str, attempt: int, node: int) -> dict[str, Any]:
    """A node's exit of ``attempt``, sent by a cut host's worker once it reaches Redis."""

    def sent() -> dict[str, Any] | None:
        exits = cluster.lifecycle(job_id, attempt)
        return next((e for e in exits if e["phase"] == "exited" and e["node"] == node), None)

    return dict(wait_for(sent, 60, "the cut host's late exit", every=0.2))


def test_one_job_outlives_a_host_lost_a_host_cut_off_and_redis_lost_and_trains_like_one_host(
    cluster: HostCluster,
) -> None:
    """A 2-node x 2-rank job across two hosts, beside the same job as 1 node x 4 ranks on one
    host (the reference). Attempt 1's steps are the reference's, bit for bit. Then:
    1. node 1's host is lost (every process killed, link down): attempt 1 ends within the
       heartbeat's TTL + grace, and attempt 2 runs on two other hosts;
    2. node 1's host of attempt 2 is cut off, alive: the service calls attempt 2 lost and
       attempt 3 runs elsewhere; when the link is back, the old node stops (superseded,
       or stopped), and nothing attempt 2 sent after it was called lost is stored;
    3. Redis becomes unreachable from node 1's host of attempt 3 only: its worker leaves the
       registry saying why, its node ends, attempt 4 runs elsewhere;
    and the job succeeds at attempt 4, every step within 1e-6 of the reference."""
    reference = submit(cluster, "hosts-1x4", 1, 4)
    job_id = submit(cluster, "hosts-2x2", 2, 2, retries=3)

    # 1. A host lost.
    placed = _running(cluster, job_id, 1, None)
    _checkpointed(cluster, job_id, 0)
    victim = placed[1]
    lost_at = time.time()
    assert victim.kill_all() > 0
    victim.link(False)
    first = _ended(cluster, job_id, 1)
    took = datetime.fromisoformat(first["ended_at"]).timestamp() - lost_at
    print(
        f"\nhost lost -> attempt 1 {first['reason']} after {took:.1f} s (ttl+grace {TTL_GRACE:g})"
    )
    # Ended by the victim's heartbeat expiring (lost), or sooner by the surviving node's
    # ranks failing on their vanished peers (exit_code); never by a collective's timeout.
    assert first["reason"] in ("lost", "exit_code"), first
    assert took <= TTL_GRACE + 5, "the heartbeat expiry or the peers' failure ended it"

    # 2. A host cut off, alive.
    placed = _running(cluster, job_id, 2, victim)
    since = _published(cluster, job_id)
    revived = cluster.restart_worker(victim)  # back: the spare for the next fault
    _checkpointed(cluster, job_id, since)
    cut = placed[1]
    cut.link(False)
    second = _ended(cluster, job_id, 2)
    assert second["reason"] == "lost", second
    cut_at = datetime.fromisoformat(second["ended_at"]).timestamp()
    cluster.wait_registered(revived)
    placed = _running(cluster, job_id, 3, cut)
    since = _published(cluster, job_id)
    old = set(_ours(cluster, cut))
    assert old, "cut off, its node of attempt 2 still runs"

    # 3. Redis unreachable from node 1's host of attempt 3 only, while the cut host comes
    #    back. Its node trains on with node 0 until the service, its heartbeat gone, stops
    #    node 0; even if it reached the last step first, its exit cannot be sent, so the job
    #    ends at attempt 4 (a finished run resumes from its last checkpoint and ends).
    _checkpointed(cluster, job_id, since)
    far = placed[1]
    assert far.relay is not None and cut.relay is not None
    far.relay.cut()
    cut.link(True)
    cut.relay.reset()
    # Back, its node stops at once, by whichever word reaches it first: the job's fence
    # raised by attempt 3 (superseded), the service's stop of the old attempt (cancelled),
    # or its ranks failing on their peer, long gone (exit_code).
    wait_for(lambda: not old & set(cut.pids()), 60, "the cut host's old node to stop", 0.2)
    late = _late_exit(cluster, job_id, 2, 1)
    print(f"cut-off node's exit: {late['reason']}: {late['message'][:160]}")
    assert late["reason"] in ("superseded", "cancelled", "exit_code"), late
    cluster.wait_registered(cluster.worker_on(cut))

    third = _ended(cluster, job_id, 3)
    assert third["reason"] == "lost", third
    _running(cluster, job_id, 4, far)
    name = cluster.worker_on(far)
    stale = float(SETTINGS["TRAINQ_WORKER_STALE_S"])
    wait_for(lambda: not cluster.registered(name), stale + 10, f"{name} to leave the registry")
    assert "cannot reach Redis" in cluster.workers[name].tail(400)
    # Its node's peer was stopped by the service: not left half-running.
    wait_for(lambda: not _ours(cluster, far), 60, "the Redis-cut host's node to end", 0.2)

    done = cluster.wait_job(job_id, DONE, 150)
    assert done["status"] == "succeeded" and done["attempt"] == 4, done
    assert "resumed from" in cluster.logs(job_id, attempt=4)
    far.relay.resume()
    wait_for(lambda: cluster.registered(name), 30, f"{name} back in the registry", every=0.2)

    one = cluster.wait_job(reference, DONE, 150)
    assert one["status"] == "succeeded", one
    one_host = losses(cluster.metrics(reference))
    points = cluster.metrics(job_id)["points"]
    across = {p["step"]: p["loss"] for p in points if p["attempt"] == 1}
    assert len(across) >= 5, "attempt 1 ran to its first checkpoint at least"
    differ = {s: (across[s], one_host[s]) for s in across if across[s] != one_host[s]}
    print(f"2 hosts x 2 ranks vs 1 host x 4 ranks, {len(across)} steps: {len(differ)} differ")
    assert differ == {}
    # Nothing attempt 2 sent after the service called it lost was stored.
    assert [p for p in points if p["attempt"] == 2 and p["ts"] > cut_at] == []
    mine = losses(cluster.metrics(job_id))
    assert sorted(mine) == sorted(one_host) == list(range(1, STEPS + 1))
    worst = max(abs(mine[s] - one_host[s]) for s in mine)
    assert worst <= 1e-6, {s: (mine[s], one_host[s]) for s in mine}
    assert cluster.processes(job_id) == []
