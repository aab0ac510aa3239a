"""What one worker process shares between its running attempts: settings, slots, flags.

A slot is one concurrent attempt; with ``--gpus`` each slot owns an equal, fixed share of
the GPUs, so two runs never see the same device.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from trainer.events import Keys
from worker.address import Advertised, advertise
from worker.settings import WorkerSettings

__all__ = ["Slot", "WorkerContext", "split_gpus"]


@dataclass(frozen=True)
class Slot:
    index: int
    gpus: tuple[int, ...] | None  # None: a CPU slot


def split_gpus(gpus: Sequence[int] | None, slots: int) -> list[tuple[int, ...] | None]:
    """Deal GPUs to slots in contiguous, equal shares; ValueError if they do not divide."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    if not gpus:
        return [None] * slots
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus lists a GPU twice: {list(gpus)}")
    if len(gpus) % slots:
        raise ValueError(f"{len(gpus)} GPUs cannot be shared equally by {slots} slots")
    per = len(gpus) // slots
    return [tuple(gpus[i * per : (i + 1) * per]) for i in range(slots)]


class WorkerContext:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        queues: Sequence[str],
        slots: int = 1,
        gpus: Sequence[int] | None = None,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.host = socket.gethostname()
        self.name = name or self.host
        self.queues = list(queues)
        self.gpus = list(gpus) if gpus else None
        self.slot_count = slots
        self.keys = Keys(settings.redis_prefix)
        self._free: queue.Queue[Slot] = queue.Queue()
        for i, share in enumerate(split_gpus(gpus, slots)):
            self._free.put(Slot(i, share))
        self.preempt = threading.Event()  # set once: the worker is shutting down
        self._lock = threading.Lock()
        # (job, attempt, node): two nodes of one gang may share a worker with several slots.
        self._running: dict[tuple[str, int, int], threading.Event] = {}
        self._on_change: list[Callable[[], None]] = []
        self._redis: Any = None
        self._advertised: Advertised | None = None

    @property
    def advertised(self) -> Advertised:
        """The address other nodes reach this host at, and its interface (worker.address);
        found once, when a multi-node attempt first needs it."""
        if self._advertised is None:
            self._advertised = advertise(self.settings.broker_url, self.settings.advertise_host)
        return self._advertised

    @property
    def redis(self) -> Any:
        """One thread-safe client (its own connection pool) for the whole process."""
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(
                self.settings.redis_url, socket_timeout=5, socket_connect_timeout=2
            )
        return self._redis

    @contextmanager
    def slot(self) -> Iterator[Slot]:
        # Celery runs at most `slots` tasks at once, so one is free whenever a task starts.
        s = self._free.get()
        try:
            yield s
        finally:
            self._free.put(s)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._on_change.append(callback)

    def changed(self) -> None:
        """Tell the registry (worker.registry) to refresh the entry now."""
        for cb in self._on_change:
            cb()

    def track(self, job_id: str, attempt: int, wake: threading.Event, node: int = 0) -> None:
        with self._lock:
            self._running[(job_id, attempt, node)] = wake
        self.changed()

    def untrack(self, job_id: str, attempt: int, node: int = 0) -> None:
        with self._lock:
            self._running.pop((job_id, attempt, node), None)
        self.changed()

    def busy_slots(self) -> int:
        """Nodes of attempts this worker holds now (each takes a slot)."""
        with self._lock:
            return len(self._running)

    def running_jobs(self) -> list[str]:
        with self._lock:
            return sorted({job for job, _, _ in self._running})

    def shut_down(self) -> None:
        """Warm shutdown: every running attempt stops its run (SIGTERM, so it checkpoints)."""
        self.preempt.set()
        with self._lock:
            wakes = list(self._running.values())
        for w in wakes:
            w.set()
        self.changed()
