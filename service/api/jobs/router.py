"""Jobs: submit, list, get, cancel, delete."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from redis import RedisError
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from service.api.core.inputs import JobId, body_text, media_type, no_duplicate_keys
from service.api.core.models import TERMINAL
from service.api.core.responses import errors
from service.api.jobs import crud, job_json
from service.api.jobs.schemas import JobList, JobOut, JobSpec, JobStatus, JobSummary, PlanOut
from service.api.jobs.state import cancel_job
from service.api.jobs.submit import submit_one
from service.api.jobs.tracking import with_owner_default
from service.api.jobs.vet import needs_io, spec_from_payload, vet_spec
from service.api.scheduling.limits import (
    OwnerLimits,
)
from service.api.scheduling.pending import apending_reason, note_cancelled, pending_reason
from service.api.scheduling.retention import delete_jobs, starting_from
from service.api.streams.notify import publish_status, signal_cancel
from trainer.config import reject_nul
from trainer.plan import plan
from trainer.yamlspec import MAX_DEPTH, SpecSyntaxError, json_depth_ok, load_yaml

__all__ = ["get_job_answer", "job_out", "openapi_components", "router"]

router = APIRouter(tags=["jobs"])

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")


# Bodies this large are parsed on a worker thread, so no body holds up the event loop.
INLINE_PARSE_BYTES = 16 * 1024


def parse_spec(
    raw: bytes, content_type: str | None, data_root: Any, max_yaml_bytes: int = 64 * 1024
) -> JobSpec:
    """Body bytes to a validated JobSpec; InvalidInput names the field that is wrong.

    Strict on purpose (specs are contracts for CI): duplicate keys, YAML 1.1's surprises and
    values of the wrong JSON type are refused (``trainer.yamlspec``, the models' strict mode);
    nesting is bounded before any recursive parser sees the body."""
    if media_type(content_type) in YAML_TYPES:
        if len(raw) > max_yaml_bytes:
            raise PayloadTooLarge(
                f"a YAML body is limited to {max_yaml_bytes} bytes (TRAINQ_MAX_YAML_BYTES);"
                " send a larger spec as JSON"
            )
        try:
            payload = load_yaml(body_text(raw))
        except SpecSyntaxError as exc:
            raise InvalidInput.at(["body"], f"body is not a valid YAML spec: {exc}") from exc
    else:
        if not json_depth_ok(raw):
            raise InvalidInput.at(["body"], f"body is nested deeper than {MAX_DEPTH} levels")
        try:
            payload = json.loads(raw, object_pairs_hook=no_duplicate_keys)
        except ValueError as exc:
            raise InvalidInput.at(["body"], f"body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise InvalidInput.at(["body"], "the job spec must be an object")
    return spec_from_payload(payload, data_root)


def _check_limits(
    services: Services, principal: Principal, key: str | None, own: OwnerLimits
) -> None:
    """The owner's submit limits (``service.api.scheduling.ratelimit``): 429 past one. A replay of
    an Idempotency-Key already used creates nothing, so it is neither counted nor refused."""
    limits = services.limits
    assert limits is not None
    if key is not None:
        with services.reader.connect() as conn:
            if limits.replay(conn, principal.name, key):
                return
    limits.check(services.reader.connect, principal.name, own)


async def _owner_limits(services: Services, principal: Principal) -> OwnerLimits:
    """The caller's limits (``service.api.scheduling.limits``): cached, a query only on a miss."""
    if services.limits is None:
        return OwnerLimits.merged(services.settings)
    owners = services.limits.owners
    own = owners.cached(principal.name)
    if own is None:
        own = await run_in_threadpool(owners.get, services.reader.connect, principal.name)
    return own


def _queue_devices(services: Services, queue: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The devices of the live workers serving ``queue``, each ``{"memory_bytes": n}``, or
    None and why not. A GPU worker's entry lists ``gpu_memory_bytes`` (one per GPU, in
    ``gpus``' order, from nvidia-smi: worker/registry.py); a CPU worker's, or one without
    nvidia-smi, has none, and then the queue's devices are not known."""
    try:
        workers = [w for w in services.live_workers() if queue in (w.get("queues") or ())]
    except RedisError:
        return None, "the worker registry is unreachable right now"
    if not workers:
        return None, f"no worker serves queue {queue}"
    devices: list[dict[str, Any]] = []
    for w in workers:
        gpus, memory = w.get("gpus"), w.get("gpu_memory_bytes")
        if not gpus or not isinstance(memory, list) or len(memory) != len(gpus):
            return None, "the queue's workers do not report device memory"
        devices += [
            {"worker": w.get("name"), "gpu": g, "memory_bytes": m}
            for g, m in zip(gpus, memory, strict=True)
        ]
    return devices, ""


def _plan_answer(services: Services, spec: JobSpec) -> Response:
    """The dry run's answer: the spec's plan against its queue's devices (trainer.plan)."""
    devices, why = _queue_devices(services, spec.queue)
    found = plan(
        spec.train,
        procs_per_node=spec.procs_per_node,
        nodes=spec.nodes,
        data_root=services.settings.data_root,
        devices=devices,
        devices_unknown=why,
    )
    return _json(PlanOut.model_validate(found))


def job_out(row: Any, attempts: list[Any] | None = None, pending: str | None = None) -> JobOut:
    return JobOut.model_validate(
        {
            **row,
            "latest": row["last_metrics"],
            "attempts": [dict(a) for a in attempts or ()],
            "pending_reason": pending,
        }
    )


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


_SPEC_BODY = {"$ref": "#/components/schemas/JobSpec"}


def openapi_components() -> dict[str, Any]:
    """JobSpec and its parts, for the request body the submit route reads by hand."""
    schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"JobSpec": schema, **defs}


@router.post(
    "/v1/jobs",
    status_code=201,
    response_model=JobOut,
    responses={
        200: {
            "model": JobOut | PlanOut,
            "description": "the job this Idempotency-Key already created (JobOut), or with"
            " dry_run=true the plan of the spec (PlanOut): nothing stored, nothing sent",
        },
        **errors(401, 403, 409, 429),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                media: {"schema": _SPEC_BODY} for media in ("application/json", *YAML_TYPES[:1])
            },
        }
    },
)
async def submit_job(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
    ] = None,
    dry_run: Annotated[
        bool,
        Query(description="validate as a submit does and answer the plan; store and send nothing"),
    ] = False,
) -> Response:
    """Submit a training job (JSON or YAML body); a repeated Idempotency-Key returns its job.
    With ``dry_run=true``: the same validation (and 4xx), then 200 with the spec's plan
    (parameters, tokens per step, memory per device, whether it fits the queue's devices)."""
    raw = await request.body()
    content_type = request.headers.get("content-type")
    args = (raw, content_type, services.settings.data_root, services.settings.max_yaml_bytes)
    if len(raw) > INLINE_PARSE_BYTES or media_type(content_type) in YAML_TYPES:
        spec = await run_in_threadpool(parse_spec, *args)
    else:
        spec = parse_spec(*args)
    own = await _owner_limits(services, principal)
    spec = with_owner_default(spec, own.tracking)  # once: vet_spec finds it done
    if needs_io(spec):  # a store, a file or DNS to read: on a worker thread
        spec, disk = await run_in_threadpool(
            vet_spec, services.settings, services.reader, principal, spec, own
        )
    else:
        spec, disk = vet_spec(services.settings, services.reader, principal, spec, own)
    if dry_run:
        return await run_in_threadpool(_plan_answer, services, spec)
    if services.limits is not None and (own.submits_per_minute or own.max_queued):
        await run_in_threadpool(_check_limits, services, principal, idempotency_key, own)
    # Under TRAINQ_RUNS_MAX_OWNER_BYTES the job goes alone, checked under its owner's lock.
    room = services.settings.runs_max_owner_bytes if disk else 0
    row = crud.job_row(principal, spec, idempotency_key, disk)
    if services.submits is not None and not room and await services.submits.add(row):
        created = True  # committed with the other submits of its batch (service.api.jobs.submit)
    else:
        row, created = await run_in_threadpool(
            submit_one, services, principal, spec, idempotency_key, disk_bytes=disk, room=room
        )
    first = {
        "number": 1,
        "status": "dispatched",
        "created_at": row["created_at"],
    }
    attempts = [first] if created else None
    if not created:
        return await run_in_threadpool(_get, services, principal, row["id"], False)
    return _json(job_out(row, attempts), 201)


def _query_text(field: str, value: str) -> None:
    """The spec's string check (``reject_nul``) on a query parameter, as a 422 naming it."""
    try:
        reject_nul(value)
    except ValueError as exc:
        raise InvalidInput.at(["query", field], str(exc)) from exc


def _labels(values: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        key, sep, wanted = value.partition(":")
        if not sep or not key:
            raise InvalidInput.at(["query", "label"], f"label filter {value!r} is not key:value")
        _query_text("label", value)
        pairs.append((key, wanted))
    return pairs


@router.get("/v1/jobs", response_model=JobList, responses=errors(401))
def list_jobs(
    services: ServicesDep,
    principal: PrincipalDep,
    status: JobStatus | None = None,
    name: Annotated[str | None, Query(max_length=200)] = None,
    label: Annotated[list[str], Query(max_length=20, description="key:value")] = [],  # noqa: B006
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """List jobs newest first, with filters and an opaque keyset cursor."""
    if name is not None:
        _query_text("name", name)
    after = crud.decode_cursor(cursor) if cursor else None
    with services.reader.connect() as session:
        rows, next_cursor = crud.list_jobs(
            session,
            principal,
            status=status,
            name=name,
            labels=_labels(label),
            limit=limit,
            after_id=after,
        )
    items = [JobSummary.model_validate({**r, "latest": r["last_metrics"]}) for r in rows]
    return _json(JobList(items=items, next_cursor=next_cursor))


# A queued job always says why it waits; with Redis unreachable (restarting, say), the
# registry cannot tell whether a worker serves the queue, and the answer says so.
NO_REGISTRY = "waiting in queue {}; the worker registry is unreachable right now"


def _served(queue: str, workers: list[dict[str, Any]]) -> bool:
    return any(queue in (w.get("queues") or ()) for w in workers)


def _pending_reason(services: Services, session: Any, row: Any, admin: bool) -> str:
    queue = row["queue"]
    try:
        workers = services.live_workers()
    except RedisError:
        return NO_REGISTRY.format(queue)  # the job is still answered; only the hint is vague
    if not _served(queue, workers):
        return f"no worker serves queue {queue}"
    if services.dispatcher.admits:
        why = pending_reason(services.redis, services.keys, row["id"], queue, admin=admin)
        if why is not None:
            return why
    return f"position {crud.queue_position(session, queue, row['id'])} in queue {queue}"


def _get(services: Services, principal: Principal, job_id: str, pending: bool = True) -> Response:
    with services.reader.connect() as session:
        row, attempts = crud.get_job_with_attempts(session, principal, job_id)
        if row is None:
            raise NotFound(f"job {job_id} not found")
        reason = (
            _pending_reason(services, session, row, principal.admin)
            if pending and row["status"] == "queued"
            else None
        )
    return _json(job_out(row, attempts, reason))


async def get_job_answer(services: Services, principal: Principal, job_id: str) -> Response:
    """The answer of ``GET /v1/jobs/{id}`` (the route's, and the edge's fast path's)."""
    if services.areader is not None:
        return await _aget(services, principal, job_id)
    return await run_in_threadpool(_get, services, principal, job_id)


async def _aget(services: Services, principal: Principal, job_id: str) -> Response:
    """``_get`` on the event loop (PostgreSQL): the database writes the JSON (see
    ``job_json.aget_job_json``), and concurrent requests' reads share one statement; a queued
    job's position (when a worker serves its queue) takes a second, shared the same way."""
    reader = services.areader
    assert reader is not None
    found = await job_json.aget_job_json(reader, principal, job_id)
    if found is None:
        raise NotFound(f"job {job_id} not found")
    status, queue, head, tail = found
    reason = None
    if status == "queued":
        try:
            workers = await services.alive_workers()
        except RedisError:
            reason = NO_REGISTRY.format(queue)  # the job is still answered
        else:
            if not _served(queue, workers):
                reason = f"no worker serves queue {queue}"
            elif services.dispatcher.admits and (
                why := await apending_reason(
                    services.aredis, services.keys, job_id, queue, admin=principal.admin
                )
            ):
                reason = why
            else:
                position = await crud.aqueue_position(reader, job_id)
                reason = f"position {position} in queue {queue}"
    body = f"{head}{json.dumps(reason)}{tail}".encode()
    return Response(body, media_type="application/json")


@router.get("/v1/jobs/{job_id}", response_model=JobOut, responses=errors(401, 404))
async def get_job(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """One job: spec, status, attempts, latest metrics, and why it waits if queued."""
    return await get_job_answer(services, principal, job_id)


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobOut, responses=errors(401, 404))
def cancel(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Cancel a job (idempotent): queued ends at once, running becomes cancelling."""
    with services.sessions() as session:
        row = crud.get_job(session, principal, job_id)
    if row is None:
        raise NotFound(f"job {job_id} not found")
    if row["status"] in ("queued", "running"):
        # The flag first: if Redis is down this is a 503 and nothing has changed.
        signal_cancel(services.redis, services.keys, job_id)
        with services.sessions() as session, session.begin():
            outcome = cancel_job(session, job_id)
        if services.dispatcher.admits:
            done = [c.job_id for c in outcome.changes if c.status == "cancelled"]
            note_cancelled(services.redis, services.settings.redis_prefix, done)
        publish_status(
            services.redis,
            services.keys,
            outcome.changes,
            maxlen=services.settings.job_stream_maxlen,
        )
    return _get(services, principal, job_id, pending=False)


@router.delete(
    "/v1/jobs/{job_id}",
    status_code=204,
    response_class=Response,
    responses=errors(401, 404, 409),
)
def delete_job(job_id: JobId, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Delete a finished job: its record, attempts, metrics and logs (and its run folder with
    TRAINQ_RETENTION_REMOVE_RUNS); 409 while it is queued, running or cancelling."""
    with services.sessions() as session:
        row = crud.get_job(session, principal, job_id)
    if row is None:
        raise NotFound(f"job {job_id} not found")
    if row["status"] not in TERMINAL:
        then = "wait until it has stopped" if row["status"] == "cancelling" else "cancel it first"
        raise Conflict(f"job {job_id} is {row['status']}; {then}")
    with services.sessions() as session:
        users = starting_from(session, [job_id])
    if users:
        raise Conflict(_held_message(principal, job_id, users))
    settings = services.settings
    deleted = delete_jobs(
        services.sessions,
        [job_id],
        settings.runs_root,
        settings.retention_remove_runs,
        redis=services.redis,
        keys=services.keys,
    )
    if not deleted:  # deleted meanwhile, or named as an init.job meanwhile (a retry says which)
        raise NotFound(f"job {job_id} not found")
    return Response(status_code=204)


def _held_message(principal: Principal, job_id: str, users: list[tuple[str, str, str]]) -> str:
    """The 409 of a job that active jobs start from: the caller's own (an admin: all) by id,
    other owners' only counted."""
    shown = [j for _, j, owner in users if principal.admin or owner == principal.name]
    others = len(users) - len(shown)
    named = ", ".join(shown)
    if others:
        named += f"{' and ' if shown else ''}{others} job(s) of other owners"
    return (
        f"job {job_id} is the train.init.job of queued or running job(s) {named}; it is kept"
        " until they end (cancel them or wait)"
    )
