"""The error answers the generation routes document (OpenAPI)."""

from __future__ import annotations

from typing import Any

from service.api.core.responses import errors

__all__ = ["RESPONSES"]

RESPONSES: dict[int | str, Any] = {
    **errors(401, 404, 409, 429),
    502: {"description": "the worker generating the answer stopped (TRAINQ_WORKER_STALE_S)"},
    504: {"description": "the generation deadline passed (TRAINQ_GENERATE_TIMEOUT_S)"},
    200: {
        "description": "the answer, or with stream=true its chunks as Server-Sent Events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}
