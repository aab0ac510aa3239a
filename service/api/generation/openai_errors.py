"""Errors on the OpenAI-compatible routes in OpenAI's shape, so its SDK's exceptions carry
``.type``, ``.code`` and ``.param``::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": "invalid_value"}}

The routes (``is_openai_path``): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and
the same under ``/models/{model}/`` (a base URL per model). Every other route of trainq,
``/v1/jobs/{id}/generate`` included, keeps its ``{"detail": ...}``.

``install(app)`` wraps every exception handler the app has (trainq's and FastAPI's): on these
routes the handler's answer is reshaped, keeping its status (a 422 becomes OpenAI's 400) and
headers (``Retry-After``, ``WWW-Authenticate``). So the status a failure maps to is decided
in one place (``service.api.app``) for both shapes.

==========  =======================  ==============================================
status      type                     code
==========  =======================  ==============================================
400 (422)   invalid_request_error    missing_required_parameter, unknown_parameter,
                                     invalid_type, invalid_value; ``param`` the field
                                     as OpenAI names it (``messages[0].role``)
401         authentication_error     invalid_api_key
403         permission_error         permission_denied
404         not_found_error          model_not_found (a route: not_found)
409         invalid_request_error    conflict (e.g. no complete checkpoint yet)
413         invalid_request_error    request_too_large
429         rate_limit_error         rate_limit_exceeded
500         server_error             internal_error
502         server_error             worker_lost
503         server_error             service_unavailable
504         server_error             timeout
==========  =======================  ==============================================
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from service.api.core.errors import InvalidInput, NotFound, TrainqError

__all__ = ["error_body", "install", "is_openai_path", "param_of", "trainq_error_body"]

_OPENAI_PATH = re.compile(
    r"^(?:/models/[^/]+)?"
    r"(?:/v1/completions|/v1/chat/completions|/v1/models(?:/[^/]*)?|/tokenize|/detokenize"
    r"|/tokenizer_info)/?$"
)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "worker_lost",
    503: "service_unavailable",
    504: "timeout",
}
# A pydantic union's branch tag in a loc ("str", "list[int]", "function-after[...]"): not a
# field of ours, so not part of the param.
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "None"})


def is_openai_path(path: str) -> bool:
    return _OPENAI_PATH.match(path) is not None


def param_of(loc: list[Any] | tuple[Any, ...]) -> str | None:
    """A pydantic loc as OpenAI names the field: ``["body", "messages", 0, "role"]`` is
    ``messages[0].role``; None for the body as a whole."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _FIELD.match(part) and part not in _TAGS:
            out += f".{part}" if out else part
    return out or None


def _code_422(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "is_instance_of":
        return "invalid_type"
    return "invalid_value"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for an answer of ``status`` (a 422 is given as 400's)."""
    status = 400 if status == 422 else status
    kind = _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code or _CODES.get(status, "invalid_value" if status == 400 else None),
        }
    }


def _from_detail(status: int, detail: Any, exc: BaseException | None) -> dict[str, Any]:
    """OpenAI's body for trainq's ``{"detail": detail}`` of ``status``."""
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = first.get("loc")
        param = param_of(loc if isinstance(loc, list | tuple) else [])
        msg = str(first.get("msg") or "invalid request")
        more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
        message = f"{param}: {msg}{more}" if param else f"{msg}{more}"
        return error_body(status, message, param, _code_422(str(first.get("type") or "")))
    message = detail if isinstance(detail, str) else "the request failed"
    code = "model_not_found" if isinstance(exc, NotFound) else None
    return error_body(status, message, None, code)


def trainq_error_body(exc: TrainqError) -> dict[str, Any]:
    """OpenAI's body for one of trainq's errors (a stream's last event)."""
    detail = exc.errors if isinstance(exc, InvalidInput) else exc.message
    return _from_detail(exc.status_code, detail, exc)


Handler = Callable[[Request, Any], Response | Awaitable[Response]]


def _wrap(handler: Handler) -> Handler:
    async def handle(request: Request, exc: Any) -> Response:
        answer = handler(request, exc)
        response = await answer if inspect.isawaitable(answer) else answer
        if not is_openai_path(request.url.path):
            return response
        try:
            detail = json.loads(bytes(response.body)).get("detail")
        except (ValueError, AttributeError):
            detail = None
        status = response.status_code
        headers = {
            k: v
            for k, v in response.headers.items()
            if k.lower() in ("retry-after", "www-authenticate")
        }
        body = _from_detail(status, detail, exc)
        return JSONResponse(body, status_code=400 if status == 422 else status, headers=headers)

    return handle


def install(app: FastAPI) -> None:
    """Reshape every handler's answer on the OpenAI routes (call after the handlers are
    registered)."""
    for key, handler in list(app.exception_handlers.items()):
        app.exception_handlers[key] = _wrap(handler)
