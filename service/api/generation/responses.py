"""The answers the generation routes document (OpenAPI): trainq's own error shape on
``/v1/jobs/{id}/generate`` (``RESPONSES``), OpenAI's on the OpenAI-compatible routes
(``OPENAI_RESPONSES``: ``service.api.generation.openai_errors`` reshapes every error there,
422 becoming OpenAI's 400)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from service.api.core.responses import errors

__all__ = ["OPENAI_RESPONSES", "RESPONSES", "OpenAIError"]

_OK: dict[int | str, Any] = {
    200: {
        "description": "the answer, or with stream=true its chunks as Server-Sent Events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}
_WORKER = {
    502: "the worker generating the answer stopped (TRAINQ_WORKER_STALE_S)",
    504: "the generation deadline passed (TRAINQ_GENERATE_TIMEOUT_S)",
}

RESPONSES: dict[int | str, Any] = {
    **errors(401, 404, 409, 429),
    **{code: {"description": text} for code, text in _WORKER.items()},
    **_OK,
}


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class OpenAIError(BaseModel):
    """OpenAI's error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: OpenAIErrorBody


_OPENAI = {
    400: "invalid request; param names the field (trainq's other routes answer 422)",
    401: "missing, unknown or revoked bearer token",
    404: "no such model (or not yours)",
    409: "the model has no complete checkpoint, or it cannot be loaded",
    413: "request body over the limit",
    422: "not answered here: invalid input is OpenAI's 400",
    429: "over the owner's generations in flight; Retry-After says when to try again",
    503: "no live worker serves the model's queue, or Redis is unavailable",
    **_WORKER,
}

OPENAI_RESPONSES: dict[int | str, Any] = {
    **{code: {"description": text, "model": OpenAIError} for code, text in _OPENAI.items()},
    **_OK,
}
