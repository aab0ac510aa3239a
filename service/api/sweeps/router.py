"""Sweeps: submit, list, get, cancel."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import InvalidInput, NotFound
from service.api.core.responses import errors
from service.api.jobs.router import parse_spec
from service.api.jobs.vet import owner_limits, spec_from_payload, vet_spec
from service.api.streams.notify import publish_status, signal_cancel
from service.api.streams.schemas import METRIC_FIELDS
from service.api.sweeps import crud, space
from service.api.sweeps.schemas import SweepIn, SweepList, SweepOut

__all__ = ["router"]

router = APIRouter(tags=["sweeps"])


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _under(prefix: str, exc: InvalidInput) -> InvalidInput:
    """The job spec's errors (at ``body.*``) as the sweep's (at ``body.base.*``)."""
    moved = [{**e, "loc": ["body", prefix, *e["loc"][1:]]} for e in exc.errors]
    return InvalidInput(str(exc), moved)


def _validate(services: Services, principal: Principal, body: SweepIn) -> dict[str, Any]:
    """The base spec as a submit checks it (422 at ``base.*``), then the space (``space.*``),
    the metric and the method against it; the resolved base, as JSON."""
    settings = services.settings
    own = owner_limits(services, principal)
    try:
        spec = parse_spec(json.dumps(body.base).encode(), "application/json", settings.data_root)
        spec, _ = vet_spec(settings, services.reader, principal, spec, own)
    except InvalidInput as exc:
        raise _under("base", exc) from exc
    base = spec.model_dump(mode="json")

    def vet(payload: dict[str, Any], path: str) -> None:
        trial = spec_from_payload(payload, settings.data_root)
        urls = path.startswith("train.tracking")  # else the base's URL, checked above
        vet_spec(settings, services.reader, principal, trial, own, check_urls=urls)

    space.check_space(base, dict(body.space), vet)
    if body.metric not in ("loss", "val_loss"):
        raise InvalidInput.at(
            ["body", "metric"],
            f"{body.metric!r} is not a metric a trial reports for the sweep: loss or val_loss"
            f" (the trainer reports {', '.join(METRIC_FIELDS)})",
        )
    if body.metric == "val_loss" and spec.train.eval.every == 0:
        raise InvalidInput.at(
            ["body", "metric"], "val_loss needs base.train.eval.every > 0 (or metric: loss)"
        )
    stored = {path: p.model_dump(mode="json") for path, p in body.space.items()}
    if body.method == "grid" and space.grid_size(stored) == 0:
        raise InvalidInput.at(
            ["body", "method"], "grid needs every path to be a choice or an int range"
        )
    return base


@router.post("/v1/sweeps", status_code=201, response_model=SweepOut, responses=errors(401, 403))
def submit_sweep(body: SweepIn, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Start a sweep: trials of the base spec over the space, proposed by its method."""
    base = _validate(services, principal, body)
    with services.sessions() as session:
        sweep_id = crud.create_sweep(session, principal, body, base)
        found = crud.get_sweep(session, principal, sweep_id)
    return _json(found, 201)


@router.get("/v1/sweeps", response_model=SweepList, responses=errors(401))
def list_sweeps(
    services: ServicesDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> Response:
    """List sweeps newest first, each with its trials."""
    with services.sessions() as session:
        return _json(SweepList(items=crud.list_sweeps(session, principal, limit)))


def _get(services: Services, principal: Principal, sweep_id: str) -> SweepOut:
    with services.sessions() as session:
        found = crud.get_sweep(session, principal, sweep_id)
    if found is None:
        raise NotFound(f"sweep {sweep_id} not found")
    return found


@router.get("/v1/sweeps/{sweep_id}", response_model=SweepOut, responses=errors(401, 404))
def get_sweep(sweep_id: str, services: ServicesDep, principal: PrincipalDep) -> Response:
    """One sweep: its trials with their parameters, status and metric, and the best trial."""
    return _json(_get(services, principal, sweep_id))


@router.post("/v1/sweeps/{sweep_id}/cancel", response_model=SweepOut, responses=errors(401, 404))
def cancel(sweep_id: str, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Cancel a sweep (idempotent): no more trials, and its trials are cancelled."""
    _get(services, principal, sweep_id)
    with services.sessions() as session:
        outcome, live = crud.cancel_sweep(session, sweep_id)
    for job_id in live:
        signal_cancel(services.redis, services.keys, job_id)
    publish_status(
        services.redis, services.keys, outcome.changes, maxlen=services.settings.job_stream_maxlen
    )
    if services.dispatcher.admits and outcome.changes:
        services.dispatcher.wake()
    return _json(_get(services, principal, sweep_id))
