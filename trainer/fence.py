"""Attempt fencing: an attempt that the service has replaced publishes no checkpoint.

A host cut off from the network but still running keeps training: the service counts its
attempt lost and starts the next one elsewhere, over the same (shared) run folder. When the
link returns, the old ranks must not publish a checkpoint over the new attempt's. The fence
is one Redis hash per job, ``Keys.fence(job)``: ``attempt`` is the newest attempt that any
worker claimed (raised at claim, never lowered), ``step`` the newest checkpoint that attempt
published. Rank 0 checks the fence right before a checkpoint becomes visible (the rename of
``tmp-step-N``) and records its step after; a rank that finds a newer attempt, or cannot
reach Redis to ask, raises ``Superseded`` and the run ends (``ExitCode.SUPERSEDED``).

The worker raises the fence when it claims an attempt, and reads ``step`` back: a retry
whose run folder lacks that checkpoint runs on a host that does not share the runs root
(worker.supervise says so rather than starting again from step 0).

Both scripts touch only their key; the rank's Redis account needs ``+eval ~PREFIX:fence:*``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["Fence", "Superseded", "raise_fence"]

log = logging.getLogger(__name__)

FENCE_TTL_S = 30 * 24 * 3600

# KEYS[1] the fence; ARGV attempt, ttl ms. Returns {newest attempt, its published step}.
_RAISE = """
local cur = tonumber(redis.call('hget', KEYS[1], 'attempt') or '0')
local mine = tonumber(ARGV[1])
if mine > cur then
  redis.call('hset', KEYS[1], 'attempt', mine)
  cur = mine
end
redis.call('pexpire', KEYS[1], ARGV[2])
return {cur, tonumber(redis.call('hget', KEYS[1], 'step') or '0')}
"""

# ARGV attempt, step ('' to only check). Returns the newest attempt; records step if mine.
_CHECK = """
local cur = tonumber(redis.call('hget', KEYS[1], 'attempt') or '0')
local mine = tonumber(ARGV[1])
if cur > mine then return cur end
if cur < mine then redis.call('hset', KEYS[1], 'attempt', mine) end
if ARGV[2] ~= '' then redis.call('hset', KEYS[1], 'step', ARGV[2]) end
return mine
"""


class Superseded(Exception):
    """This attempt may not publish: a newer one was claimed, or the fence is unreachable."""


def raise_fence(client: Any, key: str, attempt: int) -> tuple[int, int]:
    """Claim-time: make ``attempt`` the fence's newest (if it is); (newest, its step)."""
    cur, step = client.eval(_RAISE, 1, key, attempt, FENCE_TTL_S * 1000)
    return int(cur), int(step)


class Fence:
    """An attempt's fence as its ranks see it: rank 0 holds the client (``client``), the
    other ranks hold one without (None), and follow rank 0's answer (trainer.checkpoint)."""

    def __init__(self, client: Any | None, key: str, attempt: int, *, wait_s: float = 60.0) -> None:
        self.client, self.key, self.attempt, self.wait_s = client, key, attempt, wait_s

    def ask(self, step: int) -> str | None:
        """Why checkpoint ``step`` must not be published; None if it may (or not rank 0)."""
        if self.client is None:
            return None
        try:
            self.check(step)
        except Superseded as exc:
            return str(exc)
        return None

    def _call(self, step: int | None) -> int:
        assert self.client is not None
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                arg = "" if step is None else str(step)
                return int(self.client.eval(_CHECK, 1, self.key, self.attempt, arg))
            except Exception as exc:  # redis.ConnectionError, TimeoutError
                if time.monotonic() >= deadline:
                    raise Superseded(
                        f"SUPERSEDED: attempt {self.attempt} cannot confirm it is still the "
                        f"job's current attempt (Redis unreachable for {self.wait_s:g} s: {exc});"
                        " its checkpoint is not published"
                    ) from exc
                log.warning("fence %s unreachable, asking again: %s", self.key, exc)
                time.sleep(1.0)

    def check(self, step: int) -> None:
        """Before checkpoint ``step`` becomes visible: Superseded if it must not."""
        assert self.client is not None
        newest = self._call(None)
        if newest > self.attempt:
            raise Superseded(
                f"SUPERSEDED: attempt {self.attempt} was replaced by attempt {newest}; "
                f"its checkpoint step {step} is not published"
            )

    def published(self, step: int) -> None:
        """After checkpoint ``step`` is complete: the next attempt must find it."""
        if self.client is None:
            return
        try:
            newest = self._call(step)
        except Superseded as exc:
            log.warning("%s", exc)
            return
        if newest > self.attempt:
            log.warning("attempt %d superseded by %d after step %d", self.attempt, newest, step)
