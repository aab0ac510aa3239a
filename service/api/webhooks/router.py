"""Webhook endpoints: create (the secret shown once), list, change, re-enable, delete; each
one's delivery log, and redelivering one delivery."""

from __future__ import annotations

import base64
import secrets
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import InvalidInput, NotFound
from service.api.core.models import (
    EVENTS,
    JOB_OWNERS,
    WEBHOOK_DELIVERIES,
    WEBHOOKS,
    new_job_id,
    utcnow,
)
from service.api.core.owner_lock import lock_owner
from service.api.core.responses import errors
from service.api.webhooks.schemas import (
    DeliveryList,
    DeliveryOut,
    WebhookCreated,
    WebhookIn,
    WebhookList,
    WebhookOut,
    WebhookPatch,
)
from service.api.webhooks.store import UNFINISHED
from trainer.outbound import OutboundRefused, Unresolved, check_url, pinned_addresses

__all__ = ["router"]

router = APIRouter(tags=["webhooks"])

WebhookId = Annotated[str, Path(pattern=r"^[0-9a-f]{1,32}$")]
_COLUMNS = [c for c in WEBHOOKS.c if c.name != "secret"]


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _check_url(services: Services, url: str) -> None:
    """422 naming ``url`` for a URL the deliverer would refuse: its form, a refused literal
    address, or a name that resolves to a refused address now. The deliverer checks the
    name again at each connection (its answer may change); a name that does not resolve
    yet is taken (its deliveries fail, and are retried, until it does)."""
    allow = services.settings.webhook_allow_loopback
    try:
        parts = check_url(url, allow_private=allow)
        host = parts.hostname or ""
        pinned_addresses(
            host, parts.port or (443 if parts.scheme == "https" else 80), allow_private=allow
        )
    except Unresolved:
        return
    except OutboundRefused as exc:
        raise InvalidInput.at(["body", "url"], f"url {exc}") from None


def _last_event(session: Session) -> int:
    return int(session.execute(select(func.coalesce(func.max(EVENTS.c.id), 0))).scalar() or 0)


def _mine(session: Session, principal: Principal, webhook_id: str) -> Any:
    row = (
        session.execute(
            select(*_COLUMNS).where(WEBHOOKS.c.id == webhook_id, WEBHOOKS.c.owner == principal.name)
        )
        .mappings()
        .first()
    )
    if row is None:
        raise NotFound(f"no webhook {webhook_id}")
    return row


@router.post("/v1/webhooks", status_code=201, response_model=WebhookCreated, responses=errors(401))
def create_webhook(services: ServicesDep, principal: PrincipalDep, body: WebhookIn) -> Response:
    """Create an endpoint for your events; the answer carries its signing secret, once."""
    _check_url(services, body.url)
    now = utcnow()
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    with services.sessions() as session, session.begin():
        # first: this owner's creates one at a time across replicas, so the count holds
        lock_owner(session, JOB_OWNERS, principal.name)
        count = session.execute(
            select(func.count()).select_from(WEBHOOKS).where(WEBHOOKS.c.owner == principal.name)
        ).scalar_one()
        if count >= services.settings.webhook_max_per_owner:
            raise InvalidInput.at(
                ["body"],
                f"at most {services.settings.webhook_max_per_owner} webhooks per owner"
                " (TRAINQ_WEBHOOK_MAX_PER_OWNER)",
            )
        row = {
            "id": new_job_id(), "owner": principal.name, "url": body.url,
            "events": list(dict.fromkeys(body.events)), "description": body.description,
            "secret": secret, "enabled": True, "disabled_reason": None,
            "after_event": _last_event(session), "failing_since": None, "failures": 0,
            "created_at": now, "updated_at": now,
        }  # fmt: skip
        session.execute(WEBHOOKS.insert().values(row))
    return _json(WebhookCreated.model_validate(row), 201)


@router.get("/v1/webhooks", response_model=WebhookList, responses=errors(401))
def list_webhooks(services: ServicesDep, principal: PrincipalDep) -> Response:
    """Your endpoints (without their secrets)."""
    with services.reader.connect() as conn:
        rows = conn.execute(
            select(*_COLUMNS).where(WEBHOOKS.c.owner == principal.name).order_by(WEBHOOKS.c.id)
        ).mappings()
        items = [WebhookOut.model_validate(dict(r)) for r in rows]
    return _json(WebhookList(items=items))


@router.get("/v1/webhooks/{webhook_id}", response_model=WebhookOut, responses=errors(401, 404))
def get_webhook(services: ServicesDep, principal: PrincipalDep, webhook_id: WebhookId) -> Response:
    """One endpoint; ``disabled_reason`` says why deliveries stopped, if they did."""
    with services.sessions() as session:
        return _json(WebhookOut.model_validate(dict(_mine(session, principal, webhook_id))))


@router.patch("/v1/webhooks/{webhook_id}", response_model=WebhookOut, responses=errors(401, 404))
def update_webhook(
    services: ServicesDep, principal: PrincipalDep, webhook_id: WebhookId, body: WebhookPatch
) -> Response:
    """Change an endpoint; ``enabled: true`` re-enables a disabled one (its pending
    deliveries resume; events from while it was disabled are not sent)."""
    values: dict[str, Any] = {"updated_at": utcnow()}
    if body.url is not None:
        _check_url(services, body.url)
        values["url"] = body.url
    if body.events is not None:
        values["events"] = list(dict.fromkeys(body.events))
    if "description" in body.model_fields_set:
        values["description"] = body.description
    with services.sessions() as session, session.begin():
        row = _mine(session, principal, webhook_id)
        if body.enabled is True and not row["enabled"]:
            values.update(
                enabled=True, disabled_reason=None, failures=0, failing_since=None,
                after_event=_last_event(session),
            )  # fmt: skip
        elif body.enabled is False and row["enabled"]:
            values.update(enabled=False, disabled_reason="disabled by its owner")
        session.execute(update(WEBHOOKS).where(WEBHOOKS.c.id == webhook_id).values(**values))
        row = _mine(session, principal, webhook_id)
    return _json(WebhookOut.model_validate(dict(row)))


@router.delete("/v1/webhooks/{webhook_id}", status_code=204, responses=errors(401, 404))
def delete_webhook(
    services: ServicesDep, principal: PrincipalDep, webhook_id: WebhookId
) -> Response:
    """Delete an endpoint and its delivery log."""
    with services.sessions() as session, session.begin():
        _mine(session, principal, webhook_id)
        session.execute(
            delete(WEBHOOK_DELIVERIES).where(WEBHOOK_DELIVERIES.c.endpoint_id == webhook_id)
        )
        session.execute(delete(WEBHOOKS).where(WEBHOOKS.c.id == webhook_id))
    return Response(status_code=204)


_DELIVERY_COLUMNS = [
    WEBHOOK_DELIVERIES.c.id, WEBHOOK_DELIVERIES.c.event_id, EVENTS.c.type,
    WEBHOOK_DELIVERIES.c.job_id, WEBHOOK_DELIVERIES.c.status, WEBHOOK_DELIVERIES.c.attempts,
    WEBHOOK_DELIVERIES.c.next_attempt_at, WEBHOOK_DELIVERIES.c.last_status,
    WEBHOOK_DELIVERIES.c.last_error, WEBHOOK_DELIVERIES.c.created_at,
    WEBHOOK_DELIVERIES.c.updated_at,
]  # fmt: skip


def _delivery(row: Any) -> DeliveryOut:
    values = dict(row)
    values["id"] = str(values["id"])
    values["event_id"] = str(values["event_id"])
    if values["status"] not in ("pending",):
        values["next_attempt_at"] = None
    return DeliveryOut.model_validate(values)


@router.get(
    "/v1/webhooks/{webhook_id}/deliveries",
    response_model=DeliveryList,
    responses=errors(401, 404),
)
def list_deliveries(
    services: ServicesDep,
    principal: PrincipalDep,
    webhook_id: WebhookId,
    status: Annotated[
        str | None, Query(pattern="^(waiting|pending|sending|delivered|failed)$")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,18}$")] = None,
) -> Response:
    """The endpoint's delivery log, newest first: status, attempts, the last error."""
    d = WEBHOOK_DELIVERIES
    with services.sessions() as session:
        _mine(session, principal, webhook_id)
        query = (
            select(*_DELIVERY_COLUMNS)
            .join(EVENTS, EVENTS.c.id == d.c.event_id)
            .where(d.c.endpoint_id == webhook_id)
            .order_by(d.c.id.desc())
            .limit(limit + 1)
        )
        if status is not None:
            query = query.where(d.c.status == status)
        if cursor is not None:
            query = query.where(d.c.id < int(cursor))
        rows = session.execute(query).mappings().all()
    items = [_delivery(r) for r in rows[:limit]]
    next_cursor = items[-1].id if len(rows) > limit else None
    return _json(DeliveryList(items=items, next_cursor=next_cursor))


@router.post(
    "/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver",
    status_code=202,
    response_model=DeliveryOut,
    responses=errors(401, 404),
)
def redeliver(
    services: ServicesDep,
    principal: PrincipalDep,
    webhook_id: WebhookId,
    delivery_id: Annotated[str, Path(pattern=r"^[0-9]{1,18}$")],
) -> Response:
    """Send a delivery again (delivered or failed): pending now, with a fresh retry window.
    It keeps its ``webhook-id``, so a receiver that already has it can tell."""
    d = WEBHOOK_DELIVERIES
    now = utcnow()
    window = services.settings.webhook_retry_window_s
    with services.sessions() as session, session.begin():
        _mine(session, principal, webhook_id)
        session.execute(
            update(d)
            .where(
                d.c.id == int(delivery_id),
                d.c.endpoint_id == webhook_id,
                d.c.status.not_in(UNFINISHED),
            )
            .values(
                status="pending",
                next_attempt_at=now,
                give_up_at=now + timedelta(seconds=window),
                updated_at=now,
            )
        )
        row = (
            session.execute(
                select(*_DELIVERY_COLUMNS)
                .join(EVENTS, EVENTS.c.id == d.c.event_id)
                .where(d.c.id == int(delivery_id), d.c.endpoint_id == webhook_id)
            )
            .mappings()
            .first()
        )
        if row is None:
            raise NotFound(f"no delivery {delivery_id} of webhook {webhook_id}")
    return _json(_delivery(row), 202)
