"""One pass at a time across API replicas: a Redis lock with a token, released only by its
holder (compare-and-delete), expiring on its own if the holder dies mid-pass.

The reconciler, the admitter and retention each run their pass under one of these."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["one_pass"]

# Compare-and-delete: a lock that expired and was taken by another replica is not ours.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@contextmanager
def one_pass(redis: Any, key: str, ttl_s: float) -> Iterator[bool]:
    """Yields True while this process holds ``key`` (then released), False if another does."""
    token = secrets.token_hex(8)
    if not redis.set(key, token, nx=True, px=max(1, int(ttl_s * 1000))):
        yield False
        return
    try:
        yield True
    finally:
        redis.eval(_RELEASE, 1, key, token)
