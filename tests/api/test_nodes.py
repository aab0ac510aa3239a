"""Multi-node attempts in the service: one message per node, and one attempt from N nodes'
events (running at the first, ended by the last success or the first failure), replay-safe."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import select

from service.api.core.models import ATTEMPTS
from service.api.streams.notify import StopSignals
from tests.api.support import Api, WorkerSim
from tests.hosts import Forwarder
from trainer.events import NODE_SEQ_SHIFT, Event, worker_source


class NodeSim(WorkerSim):
    """What node ``node``'s worker puts on the wire: its own source, seq range and keys."""

    def __init__(self, api: Api, job_id: str, node: int, attempt: int = 1) -> None:
        super().__init__(api.services.redis, api.keys, job_id, attempt)
        self.node = node
        self.source = worker_source(node)
        self.seq[self.source] = node << NODE_SEQ_SHIFT

    def claim(self, ttl: int = 10) -> None:
        a, n = self.attempt, self.node
        self.r.set(self.keys.claim(self.job_id, a, n), f"w{n}", nx=True, ex=7 * 86400)
        self.r.set(self.keys.heartbeat(self.job_id, a, n), "1", ex=ttl)

    def stop_heartbeat(self) -> None:
        self.r.delete(self.keys.heartbeat(self.job_id, self.attempt, self.node))

    def running(self) -> Event:
        data = {"phase": "running", "host": f"h{self.node}", "worker": f"w{self.node}"}
        return self.event("lifecycle", self.source, {**data, "pid": 100, "node": self.node})

    def exited(
        self, exit_code: int | None = 0, reason: str | None = None, message: str = ""
    ) -> Event:
        data = {"phase": "exited", "exit_code": exit_code, "reason": reason, "message": message}
        return self.event("lifecycle", self.source, {**data, "node": self.node})

    def log(self, *lines: tuple[int | None, str]) -> Event:
        items = [{"rank": r, "stream": "stdout", "line": t, "node": self.node} for r, t in lines]
        return self.event("log", self.source, {"lines": items})


def _statuses(api: Api, job_id: str) -> list[str]:
    return [
        json.loads(f[b"data"])["status"]
        for _, f in api.services.redis.xrange(api.keys.job(job_id))
        if f[b"kind"] == b"status"
    ]


def _node_exits(api: Api, job_id: str, number: int = 1) -> Any:
    with api.services.sessions() as session:
        return session.execute(
            select(ATTEMPTS.c.node_exits).where(
                ATTEMPTS.c.job_id == job_id, ATTEMPTS.c.number == number
            )
        ).scalar_one()


def _sent(api: Api) -> list[dict[str, Any]]:
    """The job messages in the Celery queue (kombu's Redis list), oldest first."""
    broker = redis_lib.Redis.from_url(api.settings.broker_url)
    try:
        raw = broker.lrange(api.broker_queue, 0, -1)
    finally:
        broker.close()
    import base64

    bodies = [json.loads(base64.b64decode(json.loads(r)["body"])) for r in reversed(raw)]
    return [args[0] for args, _, _ in bodies]


def test_one_message_per_node_and_the_attempt_succeeds_when_every_node_did(api: Api) -> None:
    job = api.submit(nodes=3, procs_per_node=2)
    msgs = _sent(api)
    assert [(m["job_id"], m["attempt"], m["node_rank"], m["nodes"]) for m in msgs] == [
        (job["id"], 1, n, 3) for n in range(3)
    ]
    nodes = [NodeSim(api, job["id"], n) for n in range(3)]
    for n in nodes:
        n.claim()
    events = [nodes[1].running()]
    api.drain()
    got = api.get(job["id"])
    assert got["status"] == "running", "running at the first node's running"
    assert got["attempts"][0]["worker"] == "w1"
    events += [nodes[0].running(), nodes[2].running()]
    events += [nodes[0].log((0, "from node 0")), nodes[2].log((None, "agent of node 2"))]
    events += [nodes[2].exited(0, None, "succeeded"), nodes[0].exited(0, None, "succeeded")]
    api.drain()
    assert api.get(job["id"])["status"] == "running", "node 1 has not exited yet"
    assert set(_node_exits(api, job["id"])) == {"0", "2"}
    assert api.reconciler().run_once() == {"sent": 0, "lost": 0}, "exited nodes are not lost"
    events.append(nodes[1].exited(0, None, "succeeded"))
    api.drain()
    done = api.get(job["id"])
    assert (done["status"], done["reason"]) == ("succeeded", None), done
    assert done["attempts"][0]["status"] == "exited" and done["attempts"][0]["exit_code"] == 0
    assert _statuses(api, job["id"]) == ["running", "succeeded"]
    logs = api.client.get(f"/v1/jobs/{job['id']}/logs", headers=api.headers()).text
    assert logs == "[a1 node 0 rank 0] from node 0\n[a1 node 2 worker] agent of node 2\n"

    # Applied twice: the same events again change nothing.
    before = (api.get(job["id"]), _node_exits(api, job["id"]), logs)
    for ev in events:
        nodes[0].send(ev)
    api.drain()
    logs = api.client.get(f"/v1/jobs/{job['id']}/logs", headers=api.headers()).text
    assert (api.get(job["id"]), _node_exits(api, job["id"]), logs) == before
    assert _statuses(api, job["id"]) == ["running", "succeeded"]


def test_the_first_failing_node_ends_the_attempt_and_stops_the_others(api: Api) -> None:
    job = api.submit(nodes=2, retries=1)
    n0, n1 = NodeSim(api, job["id"], 0), NodeSim(api, job["id"], 1)
    events = [n0.running(), n1.running()]
    api.drain()
    stop = api.keys.stop(job["id"], 1)
    assert not api.services.redis.exists(stop)
    events.append(n1.exited(1, "exit_code", "rank 1 exited with exit code 1"))
    api.drain()
    got = api.get(job["id"])
    first = got["attempts"][0]
    assert (first["status"], first["reason"]) == ("exited", "exit_code")
    assert first["message"] == "node 1 of 2: rank 1 exited with exit code 1"
    assert (got["status"], got["attempt"]) == ("queued", 2), "exit_code is retried"
    assert api.services.redis.exists(stop), "the nodes still running are told to stop"
    assert not api.services.redis.exists(api.keys.stop(job["id"], 2))
    assert [m["attempt"] for m in _sent(api)] == [1, 1, 2, 2]

    # Node 0 stops (or fails on its own) after that: its exit changes nothing.
    events.append(n0.exited(None, "cancelled", "stopped: attempt 1 already ended"))
    api.drain()
    after = api.get(job["id"])
    assert after == got
    for ev in events:
        n0.send(ev)
    api.drain()
    assert api.get(job["id"]) == got
    assert _node_exits(api, job["id"]) == {"1": {"exit_code": 1, "reason": "exit_code"}}


def test_a_node_whose_heartbeat_stops_loses_the_attempt(api: Api) -> None:
    job = api.submit(nodes=2, retries=1)
    n0, n1 = NodeSim(api, job["id"], 0), NodeSim(api, job["id"], 1)
    # Node 0 claimed and waits for its gang; node 1 is still in the queue: nothing is lost.
    n0.claim()
    rec = api.reconciler()
    assert rec.run_once() == {"sent": 0, "lost": 0}
    n1.claim()
    n0.running(), n1.running()
    api.drain()
    assert rec.run_once() == {"sent": 0, "lost": 0}
    n1.stop_heartbeat()  # node 1's worker was killed; node 0 still beats
    assert rec.run_once() == {"sent": 0, "lost": 1}
    got = api.get(job["id"])
    lost = got["attempts"][0]
    assert (lost["status"], lost["reason"]) == ("lost", "lost")
    assert "heartbeat of node 1 of 2 expired" in lost["message"]
    assert (got["status"], got["attempt"]) == ("queued", 2)
    assert api.services.redis.exists(api.keys.stop(job["id"], 1))


def test_a_node_whose_exit_is_not_yet_ingested_is_not_lost(api: Api, make_settings: Any) -> None:
    """Node 1 finished first and its exit waits in the stream (ingest lags past the grace);
    node 0 still runs. Neither node is missing: the attempt succeeds once both are ingested."""
    from service.api.scheduling.reconcile import Reconciler

    s = api.services
    hasty = Reconciler(
        make_settings(redis_prefix=api.settings.redis_prefix, heartbeat_grace_s=0),
        s.sessions,
        s.redis,
        s.dispatcher,
    )
    job = api.submit(nodes=2, retries=0)
    n0, n1 = NodeSim(api, job["id"], 0), NodeSim(api, job["id"], 1)
    n0.claim(), n1.claim()
    n0.running(), n1.running()
    api.drain()
    n1.exited(0)
    n1.hand_over()
    assert hasty.run_once() == {"sent": 0, "lost": 0}
    n0.exited(0)
    n0.hand_over()
    assert hasty.run_once() == {"sent": 0, "lost": 0}
    api.drain()
    got = api.get(job["id"])
    assert got["status"] == "succeeded", got
    assert _node_exits(api, job["id"]) == {
        "0": {"exit_code": 0, "reason": None},
        "1": {"exit_code": 0, "reason": None},
    }


@pytest.fixture()
def stops_cut_off(api: Api) -> Iterator[tuple[Forwarder, StopSignals]]:
    """Stop signals whose Redis connection runs through a relay the test cuts: the store and
    the rest of Redis answer, the stop keys cannot be set until ``resume()``."""
    url = redis_lib.connection.parse_url(api.settings.redis_url)
    relay = Forwarder(("127.0.0.1", 0), (url.get("host", "127.0.0.1"), url.get("port", 6379)))
    relay.start()
    # Refused at once, not retried with backoff (redis-py's default), so the test is short.
    client = redis_lib.Redis(
        host="127.0.0.1", port=relay.port, db=url.get("db", 0), retry=Retry(NoBackoff(), 0)
    )
    try:
        yield relay, StopSignals(client, api.keys)
    finally:
        client.close()
        relay.close()


def _two_nodes(api: Api) -> tuple[dict[str, Any], NodeSim, NodeSim]:
    job = api.submit(nodes=2, retries=1)
    return job, NodeSim(api, job["id"], 0), NodeSim(api, job["id"], 1)


def test_a_stop_redis_refused_when_an_attempt_was_lost_is_said_on_the_next_pass(
    api: Api, stops_cut_off: tuple[Forwarder, StopSignals]
) -> None:
    relay, stops = stops_cut_off
    job, n0, n1 = _two_nodes(api)
    n0.claim(), n1.claim()
    n0.running(), n1.running()
    api.drain()
    rec = api.reconciler()
    rec.stops = stops
    relay.cut()
    n1.stop_heartbeat()
    assert rec.run_once() == {"sent": 0, "lost": 1}
    stop = api.keys.stop(job["id"], 1)
    assert api.get(job["id"])["attempts"][0]["status"] == "lost"  # committed all the same
    assert not api.services.redis.exists(stop)
    assert stops.unsent == [(job["id"], 1)]
    assert rec.run_once() == {"sent": 0, "lost": 0}
    assert stops.unsent == [(job["id"], 1)], "kept while Redis refuses"
    relay.resume()
    rec.run_once()
    assert stops.unsent == []
    assert api.services.redis.exists(stop) and api.services.redis.ttl(stop) > 0
    assert not api.services.redis.exists(api.keys.stop(job["id"], 2))


def test_a_stop_redis_refused_after_a_node_failed_is_said_by_the_next_batch(
    api: Api, stops_cut_off: tuple[Forwarder, StopSignals]
) -> None:
    relay, stops = stops_cut_off
    job, n0, n1 = _two_nodes(api)
    ing = api.ingestor()
    ing.stops = stops
    n0.running(), n1.running()
    api.drain(ing)
    relay.cut()
    n1.exited(1, "exit_code", "rank 1 exited with exit code 1")
    api.drain(ing)
    assert (api.get(job["id"])["status"], api.get(job["id"])["attempt"]) == ("queued", 2)
    stop = api.keys.stop(job["id"], 1)
    assert not api.services.redis.exists(stop)
    assert stops.unsent == [(job["id"], 1)]
    relay.resume()
    assert api.drain(ing) == 0  # nothing new: the batch that follows says the stop
    assert stops.unsent == [] and api.services.redis.exists(stop)


def test_unsent_stops_are_bounded_oldest_let_go_first(
    api: Api, stops_cut_off: tuple[Forwarder, StopSignals]
) -> None:
    relay, stops = stops_cut_off
    relay.cut()
    stops.limit = 2
    assert not stops.send([("a", 1), ("b", 1)])
    assert not stops.send([("c", 2)])
    assert stops.unsent == [("b", 1), ("c", 2)]
    relay.resume()
    assert stops.send()
    assert api.services.redis.exists(api.keys.stop("c", 2))
    assert not api.services.redis.exists(api.keys.stop("a", 1))
