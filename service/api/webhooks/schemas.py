"""Webhook endpoints and their deliveries, as the API takes and shows them."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.api.core.schemas import Text, UTCDatetime
from service.api.events.record import EVENT_TYPES

__all__ = [
    "DeliveryList",
    "DeliveryOut",
    "WebhookCreated",
    "WebhookIn",
    "WebhookList",
    "WebhookOut",
    "WebhookPatch",
    "matches",
]

_FAMILIES = sorted({t.split(".", 1)[0] for t in EVENT_TYPES})


def _pattern(value: str) -> str:
    if value == "*" or value in EVENT_TYPES:
        return value
    if value.endswith(".*") and value[:-2] in _FAMILIES:
        return value
    known = ", ".join([f"{f}.*" for f in _FAMILIES] + list(EVENT_TYPES))
    raise ValueError(f"unknown event type {value[:80]!r}; one of *, {known}")


Pattern = Annotated[str, Field(max_length=64), AfterValidator(_pattern)]


def matches(patterns: list[str], event_type: str) -> bool:
    """Whether an endpoint subscribed to ``patterns`` gets an event of ``event_type``."""
    for pattern in patterns:
        if pattern in ("*", event_type):
            return True
        if pattern.endswith(".*") and event_type.startswith(pattern[:-1]):
            return True
    return False


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, description="http(s); public addresses only")
    events: list[Pattern] = Field(min_length=1, max_length=20, description="e.g. job.*")
    description: Text | None = Field(None, max_length=500)


class WebhookPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, max_length=2048)
    events: list[Pattern] | None = Field(None, min_length=1, max_length=20)
    description: Text | None = Field(None, max_length=500)
    enabled: bool | None = Field(None, description="true re-enables a disabled endpoint")


class WebhookOut(BaseModel):
    id: str
    url: str
    events: list[str]
    description: str | None
    enabled: bool
    disabled_reason: str | None
    created_at: UTCDatetime
    updated_at: UTCDatetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="whsec_...: verifies the signatures; shown only here")


class WebhookList(BaseModel):
    items: list[WebhookOut]


class DeliveryOut(BaseModel):
    id: str
    event_id: str
    type: str
    job_id: str | None
    status: str = Field(
        description="waiting (behind an earlier one of its job), pending, sending, delivered"
        " or failed (gave up)"
    )
    attempts: int
    next_attempt_at: UTCDatetime | None = Field(description="pending: the next try")
    last_status: int | None = Field(description="the endpoint's last HTTP status")
    last_error: str | None
    created_at: UTCDatetime
    updated_at: UTCDatetime


class DeliveryList(BaseModel):
    items: list[DeliveryOut]
    next_cursor: str | None = None
