"""worker.genqueue: owners served in turn, arrival order within one owner."""

from __future__ import annotations

import threading

from worker.genqueue import FairQueue


def take_all(q: FairQueue[str]) -> list[str]:
    out = []
    while (got := q.get(timeout=0)) is not None:
        out.append(got[1])
    return out


def test_owners_alternate_and_keep_their_own_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.put("a", f"a{i}")
    q.put("b", "b0")
    q.put("c", "c0")
    q.put("b", "b1")
    assert len(q) == 7
    assert take_all(q) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert len(q) == 0


def test_an_owner_that_arrives_goes_before_the_one_just_served() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.put("a", f"a{i}")
    assert q.get(timeout=0) == ("a", "a0")  # a's first is being served
    q.put("b", "b0")  # b arrives behind a's burst
    assert take_all(q) == ["b0", "a1", "a2"]


def test_get_waits_for_a_put_and_drain_empties() -> None:
    q: FairQueue[str] = FairQueue()
    assert q.get(timeout=0.01) is None
    threading.Timer(0.05, q.put, ("a", "x")).start()
    assert q.get(timeout=5) == ("a", "x")
    q.put("a", "y")
    q.put("b", "z")
    assert sorted(q.drain()) == ["y", "z"] and len(q) == 0


def test_a_batch_is_filled_owner_by_owner_with_what_fits() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.put("a", f"a{i}")
    q.put("b", "x0")  # another model: never taken into this batch
    q.put("b", "b0")
    q.put("c", "c0")
    got = q.take(lambda item: not item.startswith("x"), limit=4)
    assert [item for _, item in got] == ["a0", "b0", "c0", "a1"]
    assert len(q) == 3
    assert take_all(q) == ["x0", "a2", "a3"]
    assert q.take(lambda item: True, limit=2) == []
