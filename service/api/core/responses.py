"""HTTP routes, one module per resource; ``errors`` documents the error answers they share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["CursorGoneOut", "ErrorOut", "FieldError", "ValidationOut", "errors"]


class ErrorOut(BaseModel):
    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str | None = None


class ValidationOut(BaseModel):
    detail: list[FieldError]


class CursorGoneOut(ValidationOut):
    oldest_cursor: str  # the lowest cursor the events feed reads on from


_DESCRIPTIONS = {
    401: ("missing, unknown or revoked bearer token", ErrorOut),
    403: ("the token may not do this (an admin view)", ErrorOut),
    404: ("no such job (or not yours)", ErrorOut),
    409: ("Idempotency-Key reused with a different spec", ErrorOut),
    410: (
        "the cursor is older than the events kept; oldest_cursor says where to go on",
        CursorGoneOut,
    ),
    413: ("request body over the limit", ErrorOut),
    422: ("invalid input; each error's loc names the field", ValidationOut),
    429: ("over a limit (open streams, submits); Retry-After says when to try again", ErrorOut),
    503: ("the database or Redis is unavailable", ErrorOut),
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error codes (every route may also answer 413/503)."""
    wanted = sorted({*codes, 413, 422, 503})
    return {
        code: {"description": _DESCRIPTIONS[code][0], "model": _DESCRIPTIONS[code][1]}
        for code in wanted
    }
