"""A worker that cannot reach Redis takes no task, though its broker is reachable
(worker.intake); a task it took before it knew goes back to its queue (worker.tasks).

Redis is reached through a relay (tests/hosts.Forwarder, loopback only) that the test cuts;
the broker is reached directly, as when it is another server or on another route.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis

from tests.hosts import Forwarder
from tests.worker.conftest import Wire, WorkerProc, message, new_job, tiny, wait_for
from worker.message import broker_queue


@pytest.fixture()
def relay(redis_url: str) -> Iterator[tuple[Forwarder, str]]:
    """A relay to the test's Redis, and the URL that reaches Redis through it."""
    u = urlsplit(redis_url)
    assert u.hostname is not None and u.port is not None
    fwd = Forwarder(("127.0.0.1", 0), (u.hostname, u.port)).start()
    yield fwd, f"redis://127.0.0.1:{fwd.port}{u.path}"
    fwd.close()


def test_a_worker_cut_off_redis_takes_no_task_and_hands_back_one_it_took(
    start_worker: Callable[..., WorkerProc],
    wire: Wire,
    broker_url: str,
    relay: tuple[Forwarder, str],
) -> None:
    fwd, url = relay
    broker = redis.Redis.from_url(broker_url)
    queue = broker_queue("cpu")
    # Not a run (no such dataset): each attempt ends before torchrun, once claimed.
    absent = tiny(data={"path": "absent"})

    # 1. Its registry refreshes once an hour here, so the claim is what finds Redis gone:
    #    the task goes back to its queue, unclaimed, and the worker stops consuming.
    w1 = start_worker("w1", env={"TRAINQ_REDIS_URL": url}, registry_interval_s=3600)
    fwd.cut()
    handed = new_job()
    wire.send(message(handed, procs=1, train=absent))
    wait_for(lambda: "the task goes back to queue" in w1.log(), 60, "the task handed back")
    wait_for(lambda: broker.llen(queue) == 1, 10, "the task in its queue again")
    assert "stopped consuming" in w1.log()
    assert wire.r.get(wire.keys.claim(handed, 1, 0)) is None, "nothing was claimed"
    w1.stop(signal.SIGKILL)

    # 2. A worker that reaches Redis takes it: the message handed back is whole.
    fwd.resume()
    w2 = start_worker("w2", env={"TRAINQ_REDIS_URL": url}, registry_interval_s=0.5)
    assert wire.exited(handed, 1)["reason"] == "spec_error"

    # 3. Its registry's refresh finds Redis gone: it stops consuming, and a task sent then
    #    waits in the broker (which it still reaches) until Redis answers again.
    fwd.cut()
    wait_for(lambda: "stopped consuming" in w2.log(), 30, "w2 to stop consuming")
    waiting = new_job()
    wire.send(message(waiting, procs=1, train=absent))
    time.sleep(3.0)  # many refreshes and broker polls: a consuming worker takes it at once
    assert broker.llen(queue) == 1, "not taken while Redis is out of reach"
    fwd.resume()
    assert wire.exited(waiting, 1)["reason"] == "spec_error"
    assert "resumed consuming trainq.cpu" in w2.log()
    broker.close()


def test_a_claim_whose_reply_is_lost_is_still_ours(
    wire: Wire, relay: tuple[Forwarder, str]
) -> None:
    """The SET NX ran in Redis, and its answer died with the connection: the retry finds the
    key taken by this very claim (its token), so the attempt runs rather than waiting for the
    reconciler; a second delivery of the same message is still turned away."""
    from worker.context import WorkerContext
    from worker.settings import WorkerSettings
    from worker.supervise import _claim

    fwd, url = relay
    ctx = WorkerContext(WorkerSettings(redis_url=url), queues=["cpu"], name="w1")
    job = new_job()
    msg = message(job, procs=1)
    try:
        assert ctx.redis.ping()  # connected: the next answer through the relay is the SET's
        fwd.lose_replies(1)
        assert _claim(ctx, msg), "our own claim, its reply lost, is ours"
        held = wire.r.get(wire.keys.claim(job, 1, 0))
        assert held is not None and held.split()[0] == b"w1"
        assert fwd._lose == 0, "the reply was lost (the relay dropped it)"
        assert not _claim(ctx, msg), "a second delivery of the same attempt is a duplicate"
        other = WorkerContext(WorkerSettings(redis_url=url), queues=["cpu"], name="w2")
        assert not _claim(other, msg)
        other.redis.close()
    finally:
        ctx.redis.close()
