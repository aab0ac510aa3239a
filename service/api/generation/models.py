"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models a caller can generate from,
as vLLM's OpenAI server lists them.

The list holds the caller's finished jobs (succeeded, failed or cancelled; the newest
``LIST_JOBS``) that have a complete checkpoint, each twice over: ``JOB`` (its newest
checkpoint) and ``JOB:STEP`` for each complete checkpoint, newest job first. Each card:
``id``, ``object: "model"``, ``created`` (Unix seconds: when the job ended), ``owned_by``
(the job's owner), ``root`` (the job id), ``parent`` (null) and vLLM's ``max_model_len``
(the model's context, ``train.model.seq_len``). ``/v1/models/{id}`` answers any model id
``/v1/completions`` accepts (a running job's checkpoint too); another owner's job, an
unknown step or a job without a checkpoint is a 404 ``model_not_found``.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import Conflict, NotFound
from service.api.core.models import JOBS, TERMINAL
from service.api.generation.edge import json_response
from service.api.generation.protocol import MODEL_PATTERN
from service.api.generation.responses import OPENAI_RESPONSES
from service.api.generation.service import checkpoint_steps, parse_model, resolve, seq_len_of

__all__ = ["LIST_JOBS", "router"]

# OpenAI's error shape; the answer itself is JSON
MODEL_RESPONSES: dict[int | str, Any] = {
    k: v for k, v in OPENAI_RESPONSES.items() if k not in (200, 502, 504)
}

router = APIRouter(tags=["openai"])

LIST_JOBS = 500


def _unix(when: datetime | None) -> int:
    return int(when.timestamp()) if when is not None else 0


def _card(model: str, job_id: str, owner: str, created: int, context: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": owner,
            "root": job_id, "parent": None, "max_model_len": context}  # fmt: skip


def _list(services: Services, principal: Principal) -> list[dict[str, Any]]:
    cols = (JOBS.c.id, JOBS.c.owner, JOBS.c.train, JOBS.c.created_at, JOBS.c.ended_at)
    stmt = select(*cols).where(JOBS.c.status.in_(sorted(TERMINAL)))
    if not principal.admin:
        stmt = stmt.where(JOBS.c.owner == principal.name)
    stmt = stmt.order_by(JOBS.c.created_at.desc(), JOBS.c.id.desc()).limit(LIST_JOBS)
    with services.reader.connect() as conn:
        rows = conn.execute(stmt).all()
    cards: list[dict[str, Any]] = []
    for job_id, owner, train, created_at, ended_at in rows:
        steps = checkpoint_steps(services.settings.runs_root, job_id)
        if not steps:
            continue
        created, context = _unix(ended_at or created_at), seq_len_of(train)
        cards.append(_card(job_id, job_id, owner, created, context))
        for step in reversed(steps):
            cards.append(_card(f"{job_id}:{step}", job_id, owner, created, context))
    return cards


def _retrieve(services: Services, principal: Principal, model: str) -> dict[str, Any]:
    if not re.match(MODEL_PATTERN, model):
        raise NotFound(f"model {model!r} not found: a model is a job id or job_id:step")
    job_id, step = parse_model(model)
    try:
        resolve(services, principal, job_id, step)
    except Conflict as exc:  # no checkpoint: not a model (yet)
        raise NotFound(f"model {model} not found: {exc.message}") from exc
    with services.reader.connect() as conn:
        row = conn.execute(
            select(JOBS.c.owner, JOBS.c.train, JOBS.c.created_at, JOBS.c.ended_at).where(
                JOBS.c.id == job_id
            )
        ).first()
    if row is None:  # deleted since
        raise NotFound(f"model {model} not found")
    owner, train, created_at, ended_at = row
    return _card(model, job_id, owner, _unix(ended_at or created_at), seq_len_of(train))


@router.get("/v1/models", responses=MODEL_RESPONSES)
async def list_models(services: ServicesDep, principal: PrincipalDep) -> Response:
    """The caller's finished jobs with complete checkpoints, as models (``JOB``,
    ``JOB:STEP``)."""
    cards = await run_in_threadpool(_list, services, principal)
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model}", responses=MODEL_RESPONSES)
async def retrieve_model(model: str, services: ServicesDep, principal: PrincipalDep) -> Response:
    """One model (a job id, or ``job_id:step``); 404 ``model_not_found`` if it is not the
    caller's or has no such checkpoint."""
    return json_response(await run_in_threadpool(_retrieve, services, principal, model))
