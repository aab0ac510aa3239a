"""Generation: ``POST /v1/completions`` (OpenAI's shape, so the ``openai`` client works
against trainq unchanged) and ``POST /v1/jobs/{id}/generate`` (the same, the job in the path).

Generation runs on a worker serving the job's queue, not here (service.api.generation.service relays
it). Answers: 200 (a ``text_completion``, or with ``stream`` Server-Sent Events as OpenAI
sends them, ending with ``data: [DONE]``); 404 a job that is not the caller's or an unknown
step; 409 a job without a complete checkpoint, or one that cannot be loaded; 422 a parameter
out of bounds or a prompt longer than the context; 502 the worker that took the request left
the registry (``TRAINQ_WORKER_STALE_S`` without a beat: killed or cut off); 503 no live worker
on the queue, or Redis unreachable; 504 the generation deadline
(``TRAINQ_GENERATE_TIMEOUT_S``). Once a stream has started, a later error (any of these)
arrives as ``data: {"error": {"message", "type", "code"}}`` and the stream ends without
``[DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import InvalidInput, TrainqError
from service.api.core.inputs import JobId, no_duplicate_keys
from service.api.core.responses import errors
from service.api.generation.service import (
    CompletionRequest,
    GenerateBody,
    Relay,
    completion_json,
    parse_model,
    prepare,
    sse_chunk,
    trainq_extra,
)
from trainer.yamlspec import MAX_DEPTH, json_depth_ok

__all__ = ["router"]

router = APIRouter(tags=["generate"])

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RESPONSES: dict[int | str, Any] = {
    **errors(401, 404, 409, 429),
    502: {"description": "the worker generating the answer stopped (TRAINQ_WORKER_STALE_S)"},
    504: {"description": "the generation deadline passed (TRAINQ_GENERATE_TIMEOUT_S)"},
    200: {
        "description": "a text_completion object, or with stream=true its chunks as SSE",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}


B = TypeVar("B", bound=GenerateBody)


def _body_doc(model: type[GenerateBody]) -> dict[str, Any]:
    schema = {"schema": model.model_json_schema()}
    return {"requestBody": {"required": True, "content": {"application/json": schema}}}


async def _read(request: Request, model: type[B]) -> B:
    """The JSON body as ``model``, read by hand as submits are (service.api.jobs.router):
    bounded nesting, no key twice, and every error a 422 naming the field."""
    raw = await request.body()
    if not json_depth_ok(raw):
        raise InvalidInput.at(["body"], f"body is nested deeper than {MAX_DEPTH} levels")
    try:
        payload = json.loads(raw, object_pairs_hook=no_duplicate_keys)
    except ValueError as exc:  # UnicodeDecodeError too
        raise InvalidInput.at(["body"], f"body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise InvalidInput.at(["body"], "the body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise InvalidInput.of_body("invalid generation request", exc) from exc


@router.post("/v1/completions", responses=_RESPONSES, openapi_extra=_body_doc(CompletionRequest))
async def completions(request: Request, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Generate from a job's checkpoint: ``model`` is the job id (its newest checkpoint) or
    ``job_id:step``. OpenAI's completions API: prompt (text or token ids), max_tokens,
    temperature (0: greedy), top_p, top_k (extension), seed, stop, n, stream."""
    body = await _read(request, CompletionRequest)
    job_id, step = parse_model(body.model)
    return await _generate(services, principal, job_id, step, body, body.model)


@router.post(
    "/v1/jobs/{job_id}/generate", responses=_RESPONSES, openapi_extra=_body_doc(GenerateBody)
)
async def generate(
    request: Request,
    job_id: JobId,
    services: ServicesDep,
    principal: PrincipalDep,
    step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> Response:
    """``/v1/completions`` with the job in the path (``?step=N`` for an older checkpoint)."""
    body = await _read(request, GenerateBody)
    return await _generate(services, principal, job_id, step, body, job_id)


async def _generate(
    services: Services,
    principal: Principal,
    job_id: str,
    step: int | None,
    body: GenerateBody,
    model: str,
) -> Response:
    release = await services.inflight.take(principal.name)
    streaming = False
    try:
        target, request = await run_in_threadpool(prepare, services, principal, job_id, step, body)
        relay = Relay(services, target, request)
        await relay.send()
        events = relay.events()
        try:
            start = await anext(events)  # an error before the first token is this status
            if not body.stream:
                end = start
                async for event in events:
                    end = event
                return _json(completion_json(request.id, model, start, end))
        except BaseException:
            await relay.close()
            raise
        usage = bool((body.stream_options or {}).get("include_usage"))
        response = StreamingResponse(
            _stream(relay, events, request.id, model, start, usage, release),
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
        streaming = True  # the stream releases its count when it ends
        return response
    finally:
        if not streaming:
            await release()


def _choice(index: int, text: str, finish: str | None, ids: list[int]) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
            "token_ids": ids}  # fmt: skip


def _json(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


async def _stream(
    relay: Relay,
    events: AsyncIterator[dict[str, Any]],
    request_id: str,
    model: str,
    start: dict[str, Any],
    include_usage: bool,
    release: Callable[[], Awaitable[None]],
) -> AsyncIterator[bytes]:
    created = int(time.time())
    head = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": f"step-{start.get('step')}",
    }

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_chunk({**head, "choices": choices, **extra})

    try:
        async for event in events:
            if event["type"] == "delta":
                yield chunk([_choice(i, text, None, ids) for i, text, ids in event["choices"]])
            elif event["type"] == "end":
                ends = [_choice(c["index"], "", c["finish_reason"], []) for c in event["choices"]]
                yield chunk(ends, trainq=trainq_extra(start, event))
                if include_usage:
                    yield chunk([], usage=event["usage"])
        yield sse_chunk("[DONE]")
    except TrainqError as exc:
        yield sse_chunk({"error": {"message": exc.message, "type": type(exc).__name__,
                                   "code": exc.status_code}})  # fmt: skip
    finally:
        await release()
        await relay.close()
