"""What the service writes to Redis after a commit: status events and cancel flags.

Status events go to the job's own stream (``Keys.job(id)``), where SSE followers read them
next to the worker's metrics and logs. They are a notification, not the record: the SQL row
is the truth, and a follower that misses one (the service died between commit and XADD)
still learns the terminal status from the row (``service.api.streams.sse`` checks it on every ping).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from service.api.jobs.state import StatusChange
from trainer.events import Event, Keys

__all__ = [
    "CANCEL_TTL_S",
    "StopSignals",
    "publish_status",
    "signal_cancel",
    "signal_stop",
    "status_event",
]

log = logging.getLogger(__name__)

CANCEL_TTL_S = 7 * 24 * 3600


def status_event(change: StatusChange) -> Event:
    # seq only has to grow per job for a reader; the service has no per-job counter.
    return Event(
        kind="status",
        job_id=change.job_id,
        attempt=change.attempt,
        source="service",
        seq=time.time_ns() // 1000,
        data={"status": change.status, "reason": change.reason, "message": change.message},
    )


def publish_status(
    redis: Any, keys: Keys, changes: Iterable[StatusChange], *, maxlen: int = 10_000
) -> bool:
    """XADD each change to its job's stream; False (logged) when Redis is unreachable."""
    changes = list(changes)
    if not changes:
        return True
    try:
        pipe = redis.pipeline(transaction=False)
        for change in changes:
            pipe.xadd(
                keys.job(change.job_id),
                status_event(change).to_fields(),
                maxlen=maxlen,
                approximate=True,
            )
        pipe.execute()
        return True
    except Exception as exc:  # redis.RedisError, OSError: the row is the record anyway
        log.warning("could not publish %d status event(s): %s", len(changes), exc)
        return False


def signal_cancel(redis: Any, keys: Keys, job_id: str) -> None:
    """Set the cancel flag (the truth a worker polls) and publish the id (only a wake-up)."""
    pipe = redis.pipeline(transaction=True)
    pipe.set(keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
    pipe.publish(keys.cancel_channel(), job_id)
    pipe.execute()


def signal_stop(redis: Any, keys: Keys, attempts: Iterable[tuple[str, int]]) -> bool:
    """Tell the nodes of ended attempts that still run to stop (a multi-node attempt that
    failed, an attempt called lost): the stop key is the truth, read by the worker whenever
    Redis answers; the publish on the cancel channel only wakes them. False (logged) when
    Redis is unreachable: a node left running then ends when its peers are gone, or when
    the job's next attempt raises its fence."""
    attempts = list(attempts)
    if not attempts:
        return True
    try:
        pipe = redis.pipeline(transaction=False)
        for job_id, number in attempts:
            pipe.set(keys.stop(job_id, number), "1", ex=CANCEL_TTL_S)
            pipe.publish(keys.cancel_channel(), job_id)
        pipe.execute()
        return True
    except Exception as exc:  # redis.RedisError, OSError
        log.warning("could not stop the nodes of %d attempt(s): %s", len(attempts), exc)
        return False


class StopSignals:
    """The stop keys a loop (the reconciler, an ingestor) has to set, kept until Redis takes
    them. An attempt's ending is committed before its stop is said: when Redis fails in
    between, the stop is said again on the loop's next pass (``send()``), not dropped, so a
    node cut off when its attempt ended still finds the key once it is back. Bounded: past
    ``limit`` unsent stops the oldest are let go (the fence of the job's next attempt still
    holds them off its run, and a node whose peers are gone ends)."""

    def __init__(self, redis: Any, keys: Keys, *, limit: int = 10_000) -> None:
        self.redis, self.keys, self.limit = redis, keys, limit
        self._unsent: dict[tuple[str, int], None] = {}  # insertion-ordered set
        self._lock = threading.Lock()

    @property
    def unsent(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._unsent)

    def send(self, attempts: Iterable[tuple[str, int]] = ()) -> bool:
        """Say the stop of ``attempts`` and of every stop not yet said; False when Redis
        refused (they are kept for the next call)."""
        with self._lock:
            self._unsent.update(dict.fromkeys(attempts))
            for old in list(self._unsent)[: max(0, len(self._unsent) - self.limit)]:
                del self._unsent[old]
            todo = list(self._unsent)
        if not todo:
            return True
        if not signal_stop(self.redis, self.keys, todo):
            return False
        with self._lock:
            for sent in todo:
                self._unsent.pop(sent, None)
        return True
