"""worker.gang on a real Redis: all nodes start together, or none does."""

from __future__ import annotations

import threading
import time
from typing import Any

from worker.gang import Gang, GangState, free_port

KEY = "trainq:gang:j1:1"


def gang(client: Any, node: int, nodes: int = 2, member: str | None = None) -> Gang:
    return Gang(client, KEY, nodes=nodes, node=node, member=member or f"w{node}", ttl_s=60)


def wait_in_thread(g: Gang, timeout: float, out: dict[int, GangState]) -> threading.Thread:
    t = threading.Thread(
        target=lambda: out.__setitem__(g.node, g.wait(timeout, wake=threading.Event())),
        daemon=True,
    )
    t.start()
    return t


def test_every_node_sees_the_complete_gang_and_node_zeros_endpoint(redis_client: Any) -> None:
    first, second = gang(redis_client, 0), gang(redis_client, 1)
    assert first.join("10.0.0.1:29400")
    out: dict[int, GangState] = {}
    waiter = wait_in_thread(first, 10, out)
    time.sleep(0.3)
    assert waiter.is_alive(), "node 0 must wait for node 1"
    assert second.join()
    t = wait_in_thread(second, 10, out)
    for th in (waiter, t):
        th.join(10)
    for node in (0, 1):
        st = out[node]
        assert st.complete and st.closed is None
        assert st.endpoint == "10.0.0.1:29400" and st.joined == {0: "w0", 1: "w1"}
    assert 0 < redis_client.pttl(KEY) <= 60_000
    # A complete gang cannot be closed any more: nobody is left behind after a start.
    assert not first.close("too late")
    assert gang(redis_client, 1).state().complete


def test_an_incomplete_gang_times_out_for_every_node_and_stays_closed(redis_client: Any) -> None:
    nodes = [gang(redis_client, n, nodes=3) for n in range(3)]
    assert nodes[0].join("h:1") and nodes[1].join()
    out: dict[int, GangState] = {}
    started = time.monotonic()
    threads = [wait_in_thread(nodes[0], 1.0, out), wait_in_thread(nodes[1], 30, out)]
    for t in threads:
        t.join(15)
    # node 1 would wait 30 s: node 0's timeout closed the gang for both, at once.
    assert time.monotonic() - started < 10
    for n in (0, 1):
        st = out[n]
        assert not st.complete
        assert st.closed == (
            "gang of 3 nodes incomplete after 1 s: 2 joined (node 0 on w0, node 1 on w1)"
        )
    # The node that comes late cannot join a closed gang, so it never starts either.
    assert not nodes[2].join()
    assert nodes[2].state().closed == out[0].closed
    assert len(nodes[2].state().joined) == 2


def test_join_and_close_are_atomic_against_each_other(redis_client: Any) -> None:
    # The close that races the last join either wins (nobody starts) or loses (all start).
    for i in range(20):
        key = f"{KEY}:{i}"
        a = Gang(redis_client, key, nodes=2, node=0, member="a", ttl_s=60)
        b = Gang(redis_client, key, nodes=2, node=1, member="b", ttl_s=60)
        a.join("h:1")
        results: dict[str, bool] = {}

        def join(g: Gang = b, out: dict[str, bool] = results) -> None:
            out["join"] = g.join()

        def close(g: Gang = a, out: dict[str, bool] = results) -> None:
            out["close"] = g.close("timeout")

        t1, t2 = threading.Thread(target=join), threading.Thread(target=close)
        t1.start(), t2.start()
        t1.join(), t2.join()
        st = a.state()
        assert results["join"] != results["close"]
        assert st.complete == results["join"] and (st.closed is not None) == results["close"]


def test_a_wait_is_interruptible_and_a_rejoin_counts_once(redis_client: Any) -> None:
    g = gang(redis_client, 0)
    assert g.join("h:1") and g.join("h:1")  # a second join of the same node adds nothing
    assert redis_client.hget(KEY, "joined") == b"1"
    wake, stop = threading.Event(), threading.Event()
    out: list[GangState] = []
    t = threading.Thread(
        target=lambda: out.append(g.wait(60, wake=wake, interrupted=stop.is_set)), daemon=True
    )
    t.start()
    time.sleep(0.2)
    stop.set()
    wake.set()
    t.join(5)
    assert not t.is_alive(), "cancel and shutdown must wake a waiting node"
    assert not out[0].complete and out[0].closed is None


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
