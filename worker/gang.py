"""The gang of a multi-node attempt: each node's task meets the others in Redis before any of
them starts torchrun, so all nodes start together or none does.

``Keys.gang(job, attempt)`` is a hash: ``node:{n}`` names the worker running node n,
``joined`` counts them, ``endpoint`` is node 0's ``host:port`` (it hosts torchrun's
rendezvous store there), ``closed`` says why the gang will never start. Joining and closing
are one Lua script each, so they are atomic against each other: once every node has joined
nobody can close the gang, and once it is closed nobody joins. A node waits until one of the
two has happened, or closes the gang itself when its own wait runs out.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Gang", "GangState", "free_port"]

log = logging.getLogger(__name__)

_JOIN = """
local closed = redis.call('hget', KEYS[1], 'closed')
if closed then return 0 end
if redis.call('hsetnx', KEYS[1], 'node:' .. ARGV[1], ARGV[2]) == 1 then
  redis.call('hincrby', KEYS[1], 'joined', 1)
end
if ARGV[3] ~= '' then redis.call('hset', KEYS[1], 'endpoint', ARGV[3]) end
redis.call('pexpire', KEYS[1], ARGV[4])
return 1
"""

# 0: the gang is complete, so it stays open; 1: it is closed (now or before).
_CLOSE = """
if redis.call('hexists', KEYS[1], 'closed') == 0 then
  if tonumber(redis.call('hget', KEYS[1], 'joined') or '0') >= tonumber(ARGV[1]) then
    return 0
  end
  redis.call('hset', KEYS[1], 'closed', ARGV[2])
end
redis.call('pexpire', KEYS[1], ARGV[3])
return 1
"""


def free_port() -> int:
    """A TCP port free on this host now (torchrun binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class GangState:
    nodes: int
    joined: dict[int, str]  # node -> worker name
    endpoint: str | None
    closed: str | None  # why the gang will never start

    @property
    def complete(self) -> bool:
        return self.closed is None and len(self.joined) >= self.nodes and bool(self.endpoint)

    def who(self) -> str:
        return ", ".join(f"node {n} on {w}" for n, w in sorted(self.joined.items()))


class Gang:
    """One node's handle on its gang."""

    def __init__(
        self, client: Any, key: str, *, nodes: int, node: int, member: str, ttl_s: float
    ) -> None:
        self.client, self.key = client, key
        self.nodes, self.node, self.member = nodes, node, member
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def join(self, endpoint: str | None = None) -> bool:
        """Add this node (node 0 with its endpoint); False if the gang is already closed."""
        args = [self.node, self.member, endpoint or "", self._ttl_ms]
        return bool(self.client.eval(_JOIN, 1, self.key, *args))

    def close(self, why: str) -> bool:
        """Close the gang unless every node has joined; True if it is (now) closed."""
        return bool(self.client.eval(_CLOSE, 1, self.key, self.nodes, why, self._ttl_ms))

    def state(self) -> GangState:
        raw = {_text(k): _text(v) for k, v in self.client.hgetall(self.key).items()}
        joined = {int(k[5:]): v for k, v in raw.items() if k.startswith("node:")}
        return GangState(self.nodes, joined, raw.get("endpoint"), raw.get("closed"))

    def wait(
        self,
        timeout_s: float,
        *,
        wake: threading.Event,
        poll_s: float = 0.2,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> GangState:
        """Wait until the gang is complete or closed, ``interrupted()`` (checked whenever
        ``wake`` is set, and every ``poll_s``), or ``timeout_s`` has passed, when this node
        closes it. The state it ends in; neither complete nor closed only if interrupted."""
        deadline = time.monotonic() + timeout_s
        last: GangState | None = None
        while True:
            try:
                last = self.state()
            except Exception as exc:  # Redis away for a moment: the next round asks again
                log.warning("gang %s: %s", self.key, exc)
            if last is not None and (last.complete or last.closed is not None):
                return last
            if interrupted():
                return last or GangState(self.nodes, {}, None, None)
            if time.monotonic() >= deadline:
                return self._give_up(timeout_s, last)
            wake.wait(min(poll_s, max(0.0, deadline - time.monotonic())))
            wake.clear()

    def _give_up(self, timeout_s: float, last: GangState | None) -> GangState:
        joined = last.joined if last is not None else {self.node: self.member}
        why = (
            f"gang of {self.nodes} nodes incomplete after {timeout_s:g} s: "
            f"{len(joined)} joined ({GangState(self.nodes, joined, None, None).who()})"
        )
        try:
            self.close(why)  # refused if the last node joined just in time: then all start
            return self.state()
        except Exception as exc:
            # Unreachable Redis: nobody can learn the gang is complete, so nobody starts
            # for sure; a node that already did meets no peers and times out in torchrun.
            return GangState(self.nodes, joined, None, f"{why}; Redis unreachable: {exc}")
