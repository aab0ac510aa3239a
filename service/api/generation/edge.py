"""What the generation routes share at the HTTP edge: the body read by hand (bounded
nesting, no key twice, every error naming its field), the model a call is for, the slots it
holds, and the answers' encodings (JSON, Server-Sent Events)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from service.api.core.errors import InvalidInput, TrainqError
from service.api.core.inputs import no_duplicate_keys
from service.api.generation.openai_errors import trainq_error_body
from service.api.generation.service import parse_model
from trainer.yamlspec import MAX_DEPTH, json_depth_ok

__all__ = [
    "STREAM_HEADERS",
    "body_doc",
    "json_response",
    "model_of",
    "read_body",
    "sse",
    "sse_response",
]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
B = TypeVar("B", bound=BaseModel)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"schema": model.model_json_schema()}
    return {"requestBody": {"required": True, "content": {"application/json": schema}}}


async def read_body(request: Request, model: type[B]) -> B:
    """The JSON body as ``model``, read by hand as submits are (service.api.jobs.router):
    bounded nesting, no key twice, and every error a 422 naming the field (a 400 in
    OpenAI's shape on the OpenAI routes)."""
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


def model_of(body_model: str | None, path_model: str | None) -> tuple[str, str, int | None]:
    """(model as named, job id, step) from the body's ``model`` or the base URL's
    ``/models/{model}`` (both given: they must agree)."""
    if path_model is not None and body_model is not None and body_model != path_model:
        raise InvalidInput.at(
            ["body", "model"], f"model {body_model} is not {path_model}, this base URL's model"
        )
    model = body_model or path_model
    if model is None:
        raise InvalidInput(
            "model is required",
            [{"loc": ["body", "model"], "msg": "model is required", "type": "missing"}],
        )
    job_id, step = parse_model(model)
    return model, job_id, step


def json_response(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def sse_response(
    chunks: AsyncGenerator[bytes, None], release: Callable[[], Awaitable[None]]
) -> StreamingResponse:
    """``chunks`` as Server-Sent Events ending with ``[DONE]``; an error after the stream
    began is its last event, ``data: {"error": {...}}`` (OpenAI's error object), without
    ``[DONE]``. ``release`` gives back the call's slots when the stream ends."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
            yield sse("[DONE]")
        except TrainqError as exc:
            yield sse(trainq_error_body(exc))
        finally:
            await chunks.aclose()  # its relays closed: the worker stops what nobody reads
            await release()

    return StreamingResponse(body(), media_type="text/event-stream", headers=STREAM_HEADERS)


def now() -> int:
    return int(time.time())
