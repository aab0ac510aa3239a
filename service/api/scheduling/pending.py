"""What the admitter and the rest of the server tell each other outside SQL: the pending
reasons a pass wrote (``{prefix}:pending``, records of ``decide.Pending`` as JSON, read for
``GET /v1/jobs/{id}`` and told per viewer: other owners' names only to an admin), and the queued
jobs cancelled since its last pass (``{prefix}:admit:gone``, so it forgets them at once)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from service.api.scheduling.decide import Pending
from trainer.events import Keys

__all__ = ["apending_reason", "gone_key", "note_cancelled", "pending_reason"]

log = logging.getLogger(__name__)


def gone_key(prefix: str) -> str:
    """The set of jobs cancelled while queued since the admitter's last pass."""
    return f"{prefix}:admit:gone"


def note_cancelled(redis: Any, prefix: str, job_ids: Iterable[str]) -> None:
    """Tell the admitter these queued jobs wait no more (best effort: its periodic full
    read finds them anyway, and it never places a cancelled job: placing is a CAS)."""
    ids = list(job_ids)
    if ids:
        try:
            redis.sadd(gone_key(prefix), *ids)
        except Exception as exc:
            log.debug("admitter not told of cancelled jobs: %s", exc)


def pending_reason(redis: Any, keys: Keys, job_id: str, queue: str, *, admin: bool) -> str | None:
    """The admitter's last word on a queued job (None: it has not passed since), as its
    owner reads it (other owners counted, not named) or, ``admin``, with every name."""
    pipe = redis.pipeline(transaction=False)
    pipe.hget(f"{keys.prefix}:pending", job_id)
    pipe.hget(f"{keys.prefix}:pending:queues", queue)
    why, summary = pipe.execute()
    return _reason_text(why, summary, queue, admin)


async def apending_reason(
    redis: Any, keys: Keys, job_id: str, queue: str, *, admin: bool
) -> str | None:
    """``pending_reason`` on the event loop (a ``redis.asyncio`` client)."""
    pipe = redis.pipeline(transaction=False)
    pipe.hget(f"{keys.prefix}:pending", job_id)
    pipe.hget(f"{keys.prefix}:pending:queues", queue)
    why, summary = await pipe.execute()
    return _reason_text(why, summary, queue, admin)


def _reason_text(why: Any, summary: Any, queue: str, admin: bool) -> str | None:
    if why is not None:
        # A value that is not a record (written by an older admitter) is not shown: it may
        # name other owners. The next pass replaces it.
        record = Pending.loads(why)
        return record.text(admin=admin) if record is not None else None
    if summary is None:
        return None
    try:
        s = json.loads(summary)
        return (
            f"beyond position {int(s['detailed'])} of {int(s['queued'])} queued in queue"
            f" {queue}: waiting for the jobs ahead of it in admission order"
        )
    except (ValueError, KeyError, TypeError):
        return None
