"""Generation requests one owner has in flight, counted in Redis across API replicas.

``TRAINQ_GENERATE_MAX_PER_OWNER`` bounds them (more: 429 naming the setting): each holds a
worker's generation thread or a place in its backlog, so one tenant cannot take them all.
A call is one slot, however many prompts it carries: a completions call with a list of
prompts is fanned out to one worker request per prompt, ``TRAINQ_GENERATE_FANOUT`` (8) at a
time, the rest as earlier ones end. Counting calls, as OpenAI and vLLM count requests, lets
an evaluation harness run as many concurrent batched calls as the limit without a 429 (when
a call took a slot per prompt, lm-eval's second concurrent batch of 8 found none left); one
owner then has at most limit x fan-out worker requests queued, and the worker serves owners
in turn (``worker.genqueue``), so they do not delay another owner's.
The count used to live in one API process's memory, so N replicas let N times the limit
through. Now it is a sorted set per owner (the key holds ``owner_hash``, never the name) of
request slots scored by when each expires: one Lua script drops the expired, counts and
adds, atomically, on Redis's clock (the submit limiter's pattern,
``service.api.scheduling.ratelimit``). A request releases its slot when it ends however it
ends (answer, error, client gone, timeout); the expiry, a little past the generation
deadline, is only the safety net for an API process that died holding slots.

While Redis is unreachable the limit is not applied (logged once a minute), as with the
submit limiter; the request then fails on its own for want of the Redis wire.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from service.api.core.errors import TooManyRequests
from service.api.scheduling.ratelimit import owner_hash

__all__ = ["GRACE_S", "SLOT_MARGIN_S", "InFlight"]

log = logging.getLogger(__name__)

GRACE_S = 2.0  # the API waits this much past the worker's deadline before its own 504
SLOT_MARGIN_S = 30.0  # a slot outlives the generation deadline (and the API's grace) by this
RETRY_AFTER_S = 5
OUTAGE_LOG_S = 60.0

# KEYS[1]: the owner's set. ARGV: limit, the slots' life in ms, the slots' id prefix, how
# many are wanted. Returns how many were taken (0: at the limit, nothing added): as many as
# are free, up to the number wanted, named prefix:1..taken.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local take = math.min(free, tonumber(ARGV[4]))
if take <= 0 then
  return 0
end
for i = 1, take do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[3] .. ':' .. i)
end
redis.call('PEXPIRE', KEYS[1], ttl)
return take
"""


class InFlight:
    """The per-owner generation slots of one API process (``aredis``: redis.asyncio)."""

    def __init__(self, settings: Any, aredis: Any, prefix: str) -> None:
        self.settings = settings
        self.aredis = aredis
        self.prefix = prefix
        self._script = aredis.register_script(_TAKE)
        self._outage_logged = -OUTAGE_LOG_S

    def key(self, owner: str) -> str:
        return f"{self.prefix}:gen:inflight:{owner_hash(owner)}"

    def ttl_s(self) -> float:
        return float(self.settings.generate_timeout_s) + GRACE_S + SLOT_MARGIN_S

    async def count(self, owner: str) -> int:
        """The owner's live slots (for tests and diagnostics)."""
        now_ms = int(time.time() * 1000)
        return int(await self.aredis.zcount(self.key(owner), now_ms, "+inf"))

    async def take(self, owner: str) -> Callable[[], Awaitable[None]]:
        """Take one of ``owner``'s slots or raise TooManyRequests; the returned coroutine
        function gives it back (calling it again does nothing)."""
        _, release = await self.take_up_to(owner, 1)
        return release

    async def take_up_to(self, owner: str, want: int) -> tuple[int, Callable[[], Awaitable[None]]]:
        """Take as many of ``owner``'s free slots as there are, up to ``want`` (a call
        fanned out to ``want`` worker requests runs that many at a time), or raise
        TooManyRequests when none is free; returns how many, and the coroutine function
        that gives them all back (calling it again does nothing)."""
        limit = int(self.settings.generate_max_per_owner)
        key, slot = self.key(owner), secrets.token_hex(8)
        try:
            life_ms = int(self.ttl_s() * 1000)
            taken = int(await self._script(keys=[key], args=[limit, life_ms, slot, want]))
        except RedisError as exc:
            self._outage(exc)
            taken, key = min(want, limit), ""
        if not taken:
            raise TooManyRequests(
                f"{owner!r} has {limit} generation requests in flight already"
                " (TRAINQ_GENERATE_MAX_PER_OWNER); wait for one to end",
                retry_after=RETRY_AFTER_S,
            )
        released = False

        async def release() -> None:
            nonlocal released
            if released or not key:
                return
            released = True
            try:
                await self.aredis.zrem(key, *(f"{slot}:{i}" for i in range(1, taken + 1)))
            except RedisError as exc:  # the slot's expiry frees it
                log.warning("generation slot of %r not released: %s", owner, exc)

        return taken, release

    def _outage(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._outage_logged < OUTAGE_LOG_S:
            return
        self._outage_logged = now
        log.warning("generation in-flight limit not applied: Redis is unreachable (%s)", exc)
