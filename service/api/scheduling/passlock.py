"""One pass at a time across API replicas: a Redis lock with a token, released only by its
holder (compare-and-delete), expiring on its own if the holder dies mid-pass.

The reconciler, the admitter, the sweeper and retention each run their pass under one of
these; the first three share ``StorePass``, what such a pass holds."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from trainer.events import Keys

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from service.api.core.settings import Settings
    from service.api.scheduling.dispatch import Dispatcher

__all__ = ["StorePass", "one_pass"]

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


class StorePass:
    """A periodic pass over SQL and Redis that sends what it decides (``dispatcher``), one
    replica at a time under ``PREFIX:{lock_name}:lock``."""

    lock_name: ClassVar[str]

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis: Any,
        dispatcher: Dispatcher,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis
        self.dispatcher = dispatcher
        self.keys = Keys(settings.redis_prefix)
        self.lock_key = f"{settings.redis_prefix}:{self.lock_name}:lock"
