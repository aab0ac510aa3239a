"""The generation requests a worker took and has not started: served owners in turn.

A worker's generation threads used to take requests in arrival order, so one tenant's burst
of long requests (``n: 16``, thousands of tokens) made another's five-token completion wait
for all of them. ``FairQueue`` holds what the worker read ahead (bounded by
``TRAINQ_GENERATE_BACKLOG``) per owner, and ``get`` takes the oldest request of the owner
served least recently: round-robin between the owners waiting, and an owner that arrives
goes before one that was just served. Within one owner, arrival order.

``take`` fills a batch the same way: the requests that fit it (the same model) are taken
owner by owner in turn, so one owner's burst takes one seat of a batch per turn.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")

REMEMBERED = 4096  # owners whose last turn is remembered (the oldest are forgotten)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._waiting: dict[str, deque[T]] = {}
        self._served: OrderedDict[str, int] = OrderedDict()  # owner: its last turn's number
        self._turns = itertools.count(1)
        self._cond = threading.Condition()
        self._size = 0

    def __len__(self) -> int:
        with self._cond:
            return self._size

    def put(self, owner: str, item: T) -> None:
        self.put_many([(owner, item)])

    def put_many(self, items: list[tuple[str, T]]) -> None:
        """Several requests at once: a generation thread woken by the first finds the
        others too, so what arrived together is decoded together."""
        if not items:
            return
        with self._cond:
            for owner, item in items:
                self._waiting.setdefault(owner, deque()).append(item)
            self._size += len(items)
            self._cond.notify(len(items))

    def get(self, timeout: float) -> tuple[str, T] | None:
        """The next request by owner's turn, or None after ``timeout`` seconds."""
        with self._cond:
            if not self._size and not self._cond.wait_for(lambda: self._size > 0, timeout):
                return None
            owner = min(self._waiting, key=lambda o: self._served.get(o, 0))
            return owner, self._pop(owner, self._waiting[owner][0])

    def take(self, fits: Callable[[T], bool], limit: int) -> list[tuple[str, T]]:
        """Up to ``limit`` waiting requests for which ``fits`` holds, by owner's turn (each
        owner's oldest that fits), without waiting."""
        out: list[tuple[str, T]] = []
        with self._cond:
            while len(out) < limit:
                first = {o: next((i for i in items if fits(i)), None)
                         for o, items in self._waiting.items()}  # fmt: skip
                ready = [o for o, item in first.items() if item is not None]
                if not ready:
                    break
                owner = min(ready, key=lambda o: self._served.get(o, 0))
                out.append((owner, self._pop(owner, first[owner])))  # type: ignore[arg-type]
        return out

    def _pop(self, owner: str, item: T) -> T:
        items = self._waiting[owner]
        items.remove(item)
        if not items:
            del self._waiting[owner]
        self._size -= 1
        self._served[owner] = next(self._turns)
        self._served.move_to_end(owner)
        while len(self._served) > REMEMBERED:
            self._served.popitem(last=False)
        return item

    def drain(self) -> list[T]:
        """Everything still waiting (the worker is stopping: each gets an answer)."""
        with self._cond:
            out = [item for items in self._waiting.values() for item in items]
            self._waiting.clear()
            self._size = 0
            return out
