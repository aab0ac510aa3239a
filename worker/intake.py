"""Whether the worker takes tasks from the broker: not while Redis is out of its reach.

A task needs Redis before it can do anything (the claim, then heartbeats and events), and
the broker may be reachable when Redis is not (another server, another route, a relay). A
worker that went on consuming would take a task it can only hand back. So the registry's
refresh (worker.registry), which finds Redis gone or back every few seconds, drives this
gate: gone, the Celery consumer stops consuming every queue of the worker; back, it
consumes them again. The messages wait in the broker for a worker that can run them.

Celery's consumer is not thread-safe: the change is handed to its event loop with
``Hub.call_soon``, which wakes the loop from another thread (as worker.pool does).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["Intake"]

log = logging.getLogger(__name__)


class Intake:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._consumer: Any = None
        self._queues: list[str] = []
        self._want = True  # consume (Redis answered last time, or nothing said otherwise)
        self._have: bool | None = True  # what the consumer does now; None: not known

    def attach(self, consumer: Any) -> None:
        """The running Celery consumer (``worker_ready``'s sender) and its queues."""
        with self._lock:
            self._consumer = consumer
            self._queues = list(consumer.app.amqp.queues.consume_from)
        self._schedule()

    def follow(self, reachable: bool) -> None:
        """Redis answered (True) or not (False): consume, or stop consuming."""
        with self._lock:
            self._want = reachable
            if reachable == self._have:
                return
        self._schedule()

    def _schedule(self) -> None:
        consumer = self._consumer
        if consumer is not None and consumer.hub is not None:
            consumer.hub.call_soon(self._apply)

    def _apply(self) -> None:
        """In the consumer's event loop: bring the consumer to what was asked last."""
        with self._lock:
            want, consumer = self._want, self._consumer
            if consumer is None or want == self._have:
                return
            self._have = want
        try:
            for queue in self._queues:
                if want:
                    consumer.add_task_queue(queue)
                else:
                    consumer.cancel_task_queue(queue)
        except Exception as exc:  # the broker connection is being rebuilt: the next refresh
            log.warning("could not %s consuming: %s", "resume" if want else "stop", exc)
            with self._lock:
                self._have = None  # part done, maybe: the next refresh applies it again
            return
        log.warning(
            "resumed consuming %s" if want else "stopped consuming %s: Redis is out of reach",
            ", ".join(self._queues),
        )
