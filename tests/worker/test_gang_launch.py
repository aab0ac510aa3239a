"""Gang-launched multi-node attempts on real workers: one task per node, one torchrun each."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.worker.conftest import (
    Wire,
    WorkerProc,
    message,
    new_job,
    run_processes,
    tiny,
    wait_for,
)

STEPS = 12


def node_exits(wire: Wire, job: str, nodes: int, timeout: float = 120) -> dict[int, Any]:
    """The exit event of each of ``nodes`` nodes of attempt 1, once all have reported."""

    def all_exited() -> dict[int, Any] | None:
        found = {
            e.data["node"]: e.data
            for e in wire.events(job)
            if e.kind == "lifecycle" and e.data["phase"] == "exited"
        }
        return found if len(found) == nodes else None

    return dict(wait_for(all_exited, timeout, f"{nodes} node exits of {job}", 0.2))


def losses(wire: Wire, job: str) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in wire.metrics(job)}


def test_two_nodes_of_one_rank_train_exactly_like_one_node_of_two(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    start_worker("w1")
    start_worker("w2")
    train = tiny(steps=STEPS, checkpoint={"every": 0, "keep": 1})
    gang_job = new_job()
    for node in (0, 1):
        wire.send(message(gang_job, procs=1, nodes=2, node_rank=node, train=train))
    exits = node_exits(wire, gang_job, 2)
    # Both nodes report, each under its own source and with its node.
    by_node = {}
    for e in wire.events(gang_job):
        if e.kind == "lifecycle":
            by_node.setdefault(e.data["node"], []).append((e.source, e.data["phase"], e))
    assert sorted(by_node) == [0, 1], by_node
    workers = set()
    for node, items in by_node.items():
        source = "worker" if node == 0 else f"worker:{node}"
        assert [(s, p) for s, p, _ in items] == [(source, "running"), (source, "exited")]
        done = items[-1][2].data
        assert (done["exit_code"], done["reason"]) == (0, None), done
        workers.add(items[0][2].data["worker"])
        seqs = [e.seq for e in wire.events(gang_job) if e.source == source]
        assert seqs == list(range((node << 32) + 1, (node << 32) + len(seqs) + 1))
    assert workers == {"w1", "w2"}, "one node per worker"
    assert exits[0]["exit_code"] == 0
    # Only global rank 0 (node 0, local rank 0) reports metrics: each step once.
    assert [m["step"] for m in wire.metrics(gang_job)] == list(range(1, STEPS + 1))
    # Every line carries its node (rank 1 of node 1 prints nothing in a quiet run).
    lines = wire.log_lines(gang_job)
    assert any(ln["line"].startswith(f"step {STEPS}/{STEPS}") for ln in lines)
    assert {(ln["node"], ln["rank"]) for ln in lines} <= {(0, 0), (0, None), (1, 1), (1, None)}
    assert run_processes(runs_root / gang_job) == []

    single = new_job()
    wire.send(message(single, procs=2, train=train))
    assert wire.exited(single, 1, timeout=120)["exit_code"] == 0
    mine, ref = losses(wire, gang_job), losses(wire, single)
    assert sorted(mine) == sorted(ref) == list(range(1, STEPS + 1))
    worst = max(abs(mine[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"2 nodes x 1 proc vs 1 node x 2 procs: max relative loss difference {worst:.3g}")
    assert worst <= 1e-6, {s: (mine[s], ref[s]) for s in ref}


def test_an_incomplete_gang_starts_nothing_and_fails_with_no_worker(
    start_worker: Callable[..., WorkerProc], wire: Wire, runs_root: Path
) -> None:
    # Long enough that both nodes join (their workers are idle) on a loaded machine too.
    start_worker("w1", gang_timeout_s=8)
    start_worker("w2", gang_timeout_s=8)
    job = new_job()
    for node in (0, 1):  # node 2 of 3 is never sent: no worker would ever take it
        wire.send(message(job, procs=1, nodes=3, node_rank=node))
    exits = node_exits(wire, job, 2, timeout=60)
    phases = [e.data["phase"] for e in wire.events(job) if e.kind == "lifecycle"]
    assert "running" not in phases, "no node may start torchrun"
    for d in exits.values():
        assert (d["exit_code"], d["reason"]) == (None, "no_worker"), d
        assert d["message"].startswith("gang of 3 nodes incomplete after 8 s: 2 joined ("), d
        assert "node 0 on w" in d["message"] and "node 1 on w" in d["message"]
    assert run_processes(runs_root / job) == []


def test_a_node_waiting_for_its_gang_is_woken_by_cancel_and_by_shutdown(
    start_worker: Callable[..., WorkerProc], wire: Wire
) -> None:
    w1 = start_worker("w1", gang_timeout_s=300)
    w2 = start_worker("w2", gang_timeout_s=300)
    cancelled, preempted = new_job(), new_job()
    wire.send(message(cancelled, procs=1, nodes=2, node_rank=0))
    wait_for(lambda: wire.r.hget(wire.keys.gang(cancelled, 1), "joined") == b"1", 30, "a join")
    wire.send(message(preempted, procs=1, nodes=2, node_rank=1))
    wait_for(lambda: wire.r.hget(wire.keys.gang(preempted, 1), "joined") == b"1", 30, "a join")

    wire.cancel(cancelled)
    done = node_exits(wire, cancelled, 1, timeout=15)[0]
    assert (done["reason"], done["message"]) == ("cancelled", "cancelled before launch")
    # It left its gang closed behind it, so a node that comes later does not wait for it.
    closed = wire.r.hget(wire.keys.gang(cancelled, 1), "closed").decode()
    assert closed.startswith("node 0 on worker w") and "cancelled before launch" in closed

    holder = wire.r.hget(wire.keys.gang(preempted, 1), "node:1").decode()
    started = time.monotonic()
    {"w1": w1, "w2": w2}[holder].stop()  # SIGTERM: Celery's warm shutdown
    done = node_exits(wire, preempted, 1, timeout=15)[1]
    assert time.monotonic() - started < 30, "a warm shutdown does not wait out the gang"
    assert done["reason"] == "preempted" and "shutting down" in done["message"], done
    assert b"did not start: preempted" in wire.r.hget(wire.keys.gang(preempted, 1), "closed")
