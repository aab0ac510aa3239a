"""The events feed: an owner's events, oldest first, paged by a cursor.

Retention prunes old events (``service.api.scheduling.retention``) and records, per owner,
the highest id it pruned (``events_pruned.through_id``). A cursor below that has missed an
event, so the feed answers 410 Gone naming ``after`` (as Kubernetes' watch does for a
resource version too old) instead of reading on as if nothing were lost; a cursor at or above
it reads on as ever. Per owner, since ids are global: another owner's pruned events never
make a quiet owner's old cursor stale. ``after=0`` (the start) is never too old.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy import select

from service.api.core.deps import PrincipalDep, ServicesDep
from service.api.core.errors import Gone
from service.api.core.models import EVENTS, EVENTS_PRUNED
from service.api.core.responses import errors
from service.api.events.schemas import EventList, EventOut

__all__ = ["router"]

router = APIRouter(tags=["events"])


@router.get("/v1/events", response_model=EventList, responses=errors(401, 410))
def list_events(
    services: ServicesDep,
    principal: PrincipalDep,
    after: Annotated[str, Query(pattern=r"^[0-9]{1,18}$", description="a cursor")] = "0",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    """Your events (job, checkpoint, sweep) after the cursor, oldest first: the events your
    webhooks are sent, in the same order. 410 when events after the cursor were pruned
    (``oldest_cursor``: the lowest cursor to read on from; ``after=0`` starts again)."""
    cursor = int(after)
    with services.reader.connect() as conn:
        rows = conn.execute(
            select(EVENTS.c.id, EVENTS.c.type, EVENTS.c.created_at, EVENTS.c.data)
            .where(EVENTS.c.owner == principal.name, EVENTS.c.id > cursor)
            .order_by(EVENTS.c.id)
            .limit(limit)
        ).all()
        # Read after the events, never before: a pass that prunes deletes events and raises
        # the mark in one transaction, so if the read above missed a pruned event this read
        # (a later statement) sees the mark. The other order could read the old mark, then
        # rows with the pass's events gone: a silent gap.
        through = (
            conn.execute(
                select(EVENTS_PRUNED.c.through_id).where(EVENTS_PRUNED.c.owner == principal.name)
            ).scalar()
            if cursor
            else None
        )
    if through is not None and cursor < through:
        raise Gone(
            ["query", "after"],
            f"cursor {cursor} is older than the events kept: events of yours after it were"
            f" pruned (TRAINQ_EVENTS_RETENTION_DAYS); the oldest cursor to read on from is"
            f" {through} (after={through}), or start again from after=0 to read every event"
            " still kept",
            "cursor_expired",
            oldest_cursor=str(through),
        )
    items = [EventOut(id=str(r.id), type=r.type, timestamp=r.created_at, data=r.data) for r in rows]
    body = EventList(items=items, next_cursor=items[-1].id if items else str(cursor))
    return Response(body.model_dump_json(), media_type="application/json")
