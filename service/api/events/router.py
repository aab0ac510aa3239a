"""The events feed: an owner's events, oldest first, paged by a cursor."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy import select

from service.api.core.deps import PrincipalDep, ServicesDep
from service.api.core.models import EVENTS
from service.api.core.responses import errors
from service.api.events.schemas import EventList, EventOut

__all__ = ["router"]

router = APIRouter(tags=["events"])


@router.get("/v1/events", response_model=EventList, responses=errors(401))
def list_events(
    services: ServicesDep,
    principal: PrincipalDep,
    after: Annotated[str, Query(pattern=r"^[0-9]{1,18}$", description="a cursor")] = "0",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    """Your events (job, checkpoint, sweep) after the cursor, oldest first: the events your
    webhooks are sent, in the same order."""
    cursor = int(after)
    with services.reader.connect() as conn:
        rows = conn.execute(
            select(EVENTS.c.id, EVENTS.c.type, EVENTS.c.created_at, EVENTS.c.data)
            .where(EVENTS.c.owner == principal.name, EVENTS.c.id > cursor)
            .order_by(EVENTS.c.id)
            .limit(limit)
        ).all()
    items = [EventOut(id=str(r.id), type=r.type, timestamp=r.created_at, data=r.data) for r in rows]
    body = EventList(items=items, next_cursor=items[-1].id if items else str(cursor))
    return Response(body.model_dump_json(), media_type="application/json")
