"""The worker's entry in ``{prefix}:workers``: queues, slots, GPUs and running jobs.

Refreshed every few seconds (the service treats an entry older than 15 s as dead) and at
once whenever an attempt starts or ends; a clean shutdown removes it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from worker.context import WorkerContext

__all__ = ["Registry"]

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        ctx.on_change(self._wake.set)

    def entry(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "name": ctx.name,
            "host": ctx.host,
            "queues": ctx.queues,
            "slots": ctx.slot_count,
            "gpus": ctx.gpus,
            "running": ctx.running_jobs(),
            "draining": ctx.preempt.is_set(),  # shutting down: takes no new work
            "ts": time.time(),
        }

    def publish(self) -> bool:
        try:
            self.ctx.redis.hset(self.ctx.keys.workers, self.ctx.name, json.dumps(self.entry()))
            return True
        except Exception as exc:
            log.warning("worker registry update failed: %s", exc)
            return False

    def start(self) -> None:
        if self._thread is not None:
            return
        self.publish()
        self._thread = threading.Thread(target=self._run, name="registry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.ctx.settings.registry_interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.publish()

    def stop(self) -> None:
        """Stop refreshing and remove the entry (a clean shutdown)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.ctx.redis.hdel(self.ctx.keys.workers, self.ctx.name)
        except Exception as exc:
            log.warning("could not remove worker %s from the registry: %s", self.ctx.name, exc)
