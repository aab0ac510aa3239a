"""An event as webhooks deliver it (``EventBody``, the Standard Webhooks body) and as the
feed lists it (the same, with its cursor)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from service.api.core.schemas import UTCDatetime

__all__ = ["EventBody", "EventList", "EventOut"]


class EventBody(BaseModel):
    type: str = Field(description="job.running, job.succeeded, checkpoint.written, ...")
    timestamp: UTCDatetime = Field(description="when it happened")
    data: dict[str, Any]


class EventOut(EventBody):
    id: str = Field(description="the event's cursor: pass it as ``after`` to read on")


class EventList(BaseModel):
    items: list[EventOut]
    next_cursor: str = Field(description="``after`` for the next page (the last id read)")
