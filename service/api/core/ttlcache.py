"""A bounded map whose entries are fresh for a while: least recently used out first.

The token cache (service.api.core.auth) and the owner limits cache (service.api.scheduling.limits)
keep their answers in these, so a hot path pays a query only on a miss."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["TtlCache"]

K = TypeVar("K")
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._lock = threading.Lock()
        self._map: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def fresh(self, key: K, now: float) -> tuple[float, V] | None:
        """(when it was stored, the value) unless absent or older than ``ttl_s``."""
        with self._lock:
            hit = self._map.get(key)
            if hit is None or now - hit[0] >= self.ttl_s:
                return None
            self._map.move_to_end(key)
            return hit

    def put(self, key: K, now: float, value: V) -> None:
        with self._lock:
            self._map[key] = (now, value)
            self._map.move_to_end(key)
            while len(self._map) > self._max:
                self._map.popitem(last=False)  # the least recently used

    def pop(self, key: K) -> None:
        with self._lock:
            self._map.pop(key, None)
