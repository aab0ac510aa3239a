"""Per-owner submit limits, checked at ``POST /v1/jobs`` before a job is stored.

Two limits, each a setting (0 turns it off), each a 429 naming the limit and the setting:

- ``TRAINQ_SUBMITS_PER_MINUTE``: submits one owner may make per ``TRAINQ_SUBMIT_WINDOW_S``
  (60 s), counted in Redis so the limit holds across API replicas. A sliding-window counter:
  two fixed windows' counts, the previous one weighted by how much of it still overlaps
  the last ``window`` seconds; O(1) memory per owner whatever the limit. Redis's clock
  (``TIME``) times it, so replicas with skewed clocks share one window. ``Retry-After`` is
  the seconds until a submit would be accepted. A refused submit is not counted.
- ``TRAINQ_MAX_QUEUED_PER_OWNER``: the owner's jobs in ``queued`` status, counted in SQL
  (bounded: it stops counting at the limit). Counting is O(queued), so a process counts an
  owner's queue at most once a second while far from the limit: it adds the submits it let
  through since, and counts again near the limit (within a tenth of it) or when that is
  older. Jobs leaving the queue only make the estimate high, so it never lets one through
  that a count would refuse, but for other replicas' submits of the last second.

An owner's own ``submits_per_minute`` / ``max_queued`` (``trainq token limits``, read
through ``service.api.scheduling.limits.OwnerLimitsCache``) replace the settings for that owner.

A replay of an Idempotency-Key the owner already used is neither counted nor refused: it
creates nothing (the caller skips these checks when ``replay`` finds the key's job). The
owner's name never appears in a Redis key: the key holds a hash of it (``owner_hash``).
While Redis is unreachable the per-window limit is not applied (logged once a minute): a
submit needs only SQL (the reconciler sends it once Redis is back), and a rate limiter must
not turn a Redis outage into refused work; the queued-jobs limit, in SQL, still holds.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import func, select

from service.api.core.errors import TooManyRequests
from service.api.core.models import JOBS
from service.api.scheduling.limits import OwnerLimits, OwnerLimitsCache

__all__ = ["QUEUED_RETRY_AFTER_S", "SubmitLimits", "owner_hash"]

# How long a queued count stands in for a new one while far from the limit.
QUEUED_RECOUNT_S = 1.0

# A full queue drains at the pace jobs start, which nothing here knows: a short constant.
QUEUED_RETRY_AFTER_S = 30
OUTAGE_LOG_S = 60.0  # while Redis is away, the skipped limit is logged this often at most

log = logging.getLogger(__name__)

# KEYS[1]: the owner's key prefix. ARGV: limit, window in ms. Returns 0 (counted) or the
# milliseconds until a submit would be accepted (not counted).
_SLIDING_WINDOW = """
local limit = tonumber(ARGV[1])
local w = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = math.floor(now / w)
local elapsed = now - window * w
local cur_key = KEYS[1] .. ':' .. window
local cur = tonumber(redis.call('GET', cur_key) or '0')
local prev = tonumber(redis.call('GET', KEYS[1] .. ':' .. (window - 1)) or '0')
if prev * (w - elapsed) / w + cur + 1 <= limit then
  redis.call('INCR', cur_key)
  redis.call('PEXPIRE', cur_key, 2 * w)
  return 0
end
-- Refused: when would prev's weight (and, past this window, cur's as the next prev) let
-- one more in? Within this window if cur leaves room, else after it.
if cur + 1 <= limit then
  return math.max(1, math.ceil(w - elapsed - (limit - cur - 1) * w / prev) + 1)
end
return math.ceil(w - elapsed + w * (1 - (limit - 1) / cur)) + 1
"""


def owner_hash(owner: str) -> str:
    """A fixed-size, key-safe stand-in for an owner's name in Redis keys."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class SubmitLimits:
    """The submit limits of one API process (settings from ``service.api.core.settings``)."""

    def __init__(self, settings: Any, redis: Any, prefix: str) -> None:
        self.window_s = settings.submit_window_s
        self.prefix = prefix
        self._queued: dict[str, tuple[float, int]] = {}  # owner: (counted at, estimate)
        self._lock = threading.Lock()
        self._outage_logged = -OUTAGE_LOG_S
        # Registering sends nothing; an owner's own limit may need the script with none set.
        self._script = redis.register_script(_SLIDING_WINDOW)
        self.owners = OwnerLimitsCache(settings)  # each owner's limits over these settings

    def key(self, owner: str) -> str:
        return f"{self.prefix}:submits:{owner_hash(owner)}"

    @staticmethod
    def replay(conn: Any, owner: str, idempotency_key: str) -> bool:
        """Whether this owner already used this Idempotency-Key (the submit is a replay)."""
        found = conn.execute(
            select(JOBS.c.id).where(
                JOBS.c.owner == owner, JOBS.c.idempotency_key == idempotency_key
            )
        ).first()
        return found is not None

    def check(
        self, connect: Callable[[], Any], owner: str, limits: OwnerLimits | None = None
    ) -> None:
        """Raise TooManyRequests past a limit; else count this submit (per window).
        ``connect`` opens a database connection, only when the queue is counted or the
        owner's limits (``limits``, when not given) are not cached."""
        own = limits if limits is not None else self.owners.get(connect, owner)
        max_queued, per_window = own.max_queued, own.submits_per_minute
        if max_queued:
            count = self._queued_count(connect, owner, max_queued)
            if count >= max_queued:
                raise TooManyRequests(
                    f"owner {owner!r} has {count} queued jobs, the most allowed"
                    f" ({own.source('max_queued')});"
                    " submit again once some have started or been cancelled",
                    retry_after=QUEUED_RETRY_AFTER_S,
                )
        if per_window:
            window_ms = max(1, round(self.window_s * 1000))
            try:
                wait_ms = int(self._script(keys=[self.key(owner)], args=[per_window, window_ms]))
            except RedisError as exc:
                self._outage(exc)
                wait_ms = 0
            if wait_ms > 0:
                retry = max(1, math.ceil(wait_ms / 1000))
                raise TooManyRequests(
                    f"owner {owner!r} is over {per_window} submits per"
                    f" {self.window_s:g} s ({own.source('submits_per_minute')});"
                    f" retry after {retry} s",
                    retry_after=retry,
                )
        if max_queued:
            with self._lock:
                at, estimate = self._queued.get(owner, (0.0, 0))
                self._queued[owner] = (at, estimate + 1)

    def _outage(self, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._outage_logged < OUTAGE_LOG_S:
                return
            self._outage_logged = now
        log.warning("submit rate limit not applied: Redis is unreachable (%s)", exc)

    def _queued_count(self, connect: Callable[[], Any], owner: str, max_queued: int) -> int:
        """The owner's queued jobs: this process's estimate while it is recent and clear of
        the limit by a tenth, else counted (up to the limit) in SQL."""
        now = time.monotonic()
        with self._lock:
            at, estimate = self._queued.get(owner, (0.0, 0))
        if now - at < QUEUED_RECOUNT_S and estimate + max_queued // 10 < max_queued:
            return estimate
        queued = select(JOBS.c.id).where(JOBS.c.owner == owner, JOBS.c.status == "queued")
        with connect() as conn:
            count = int(
                conn.execute(
                    select(func.count()).select_from(queued.limit(max_queued).subquery())
                ).scalar_one()
            )
        with self._lock:
            if len(self._queued) > 10_000:
                self._queued.clear()
            self._queued[owner] = (now, count)
        return count
