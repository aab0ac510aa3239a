"""Preparation slots shared fairly between owners (one event loop; not thread safe).

``capacity`` permits; each live preparation child holds one, from its start (a warm child,
started with its upload) to its exit, so the children never outnumber the permits. A
dataset whose upload is complete and that holds none waits in :meth:`FairSlots.take`; when a
permit frees it goes to the waiting owner that holds the fewest, ties to the owner served
longest ago (round robin), and within an owner first come, first served. So one owner's
many uploads do not make another's single one wait behind all of them.

:meth:`FairSlots.try_take` (for a warm child) takes a permit only when one is free, nobody
waits for it, and the owner holds fewer than ``share``: warm children never jump the queue,
and one owner's burst of uploads leaves room for another owner's.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque

__all__ = ["FairSlots"]


class FairSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: Counter[str] = Counter()  # owner -> permits held
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._served: dict[str, int] = {}  # owner -> the serial of its last permit
        self._serial = 0

    @property
    def free(self) -> int:
        return self.capacity - self.held.total()

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def try_take(self, owner: str, share: int) -> bool:
        """A permit now, if one is free, nobody waits, and ``owner`` holds fewer than
        ``share``; else False."""
        if self.free <= 0 or self._waiting or self.held[owner] >= share:
            return False
        self._grant(owner)
        return True

    async def take(self, owner: str) -> None:
        """Wait for a permit in ``owner``'s turn."""
        if self.free > 0 and not self._waiting:
            self._grant(owner)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give(owner)  # granted, then cancelled before it resumed
            else:
                queue = self._waiting.get(owner)
                if queue is not None and fut in queue:
                    queue.remove(fut)
                    if not queue:
                        del self._waiting[owner]
            raise

    def give(self, owner: str) -> None:
        """Return one of ``owner``'s permits; the next waiting owner gets it."""
        self.held[owner] -= 1
        if self.held[owner] <= 0:
            del self.held[owner]
            if owner not in self._waiting:
                self._served.pop(owner, None)
        self._wake()

    def _wake(self) -> None:
        while self.free > 0 and self._waiting:
            owner = min(self._waiting, key=lambda o: (self.held[o], self._served.get(o, -1)))
            queue = self._waiting[owner]
            fut = queue.popleft()
            if not queue:
                del self._waiting[owner]
            if fut.done():  # cancelled while it waited
                continue
            self._grant(owner)
            fut.set_result(None)

    def _grant(self, owner: str) -> None:
        self.held[owner] += 1
        self._serial += 1
        self._served[owner] = self._serial
