"""The service's exceptions, translated to HTTP only at the route edge (``service.api.app``).

::

    TrainqError                 a clear one-line message, and the HTTP status it maps to
    ├── Unauthorized      401   missing, unknown or revoked bearer token
    ├── NotFound          404   no such job (or not yours: the same answer)
    ├── Conflict          409   an idempotency key reused with a different spec
    ├── Gone              410   what a parameter points at is no longer kept (an events
    │                           cursor older than retention); ``errors`` name the field
    ├── Forbidden         403   a valid token asking for what it may not (an admin view)
    ├── PayloadTooLarge   413   a body over TRAINQ_MAX_BODY_BYTES (or a YAML one over
    │                           TRAINQ_MAX_YAML_BYTES)
    ├── InvalidInput      422   carries pydantic-style ``errors`` with the field's ``loc``
    ├── TooManyRequests   429   over a limit (open streams); ``retry_after`` seconds
    └── Unavailable       503   a store is down; the next request tries again
        ├── DatabaseUnavailable
        └── RedisUnavailable

Third-party errors (SQLAlchemy, redis-py) are wrapped once, with ``raise ... from exc``, or
mapped by the handlers in ``service.api.app`` when they escape a route.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Conflict",
    "DatabaseUnavailable",
    "Forbidden",
    "Gone",
    "InvalidInput",
    "NotFound",
    "PayloadTooLarge",
    "RedisUnavailable",
    "TooManyRequests",
    "TrainqError",
    "Unauthorized",
    "Unavailable",
    "first_complaint",
]


class TrainqError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def first_complaint(exc: TrainqError) -> str:
    """An error in one line: its first complaint, with the field it names (InvalidInput)."""
    errors = getattr(exc, "errors", None)
    if not errors:
        return str(exc)
    loc = ".".join(str(p) for p in errors[0]["loc"] if p != "body")
    return f"{loc}: {errors[0]['msg']}" if loc else str(errors[0]["msg"])


class Unauthorized(TrainqError):
    status_code = 401


class NotFound(TrainqError):
    status_code = 404


class Forbidden(TrainqError):
    status_code = 403


class Conflict(TrainqError):
    status_code = 409


class Gone(TrainqError):
    """What the request points at (``loc``, as InvalidInput's) is no longer kept: the body
    is ``{"detail": [{"loc", "msg", "type"}], **extra}``, ``extra`` saying where to go on."""

    status_code = 410

    def __init__(self, loc: list[str | int], message: str, kind: str, **extra: str) -> None:
        super().__init__(message)
        self.errors: list[dict[str, Any]] = [{"loc": loc, "msg": message, "type": kind}]
        self.extra = extra


class PayloadTooLarge(TrainqError):
    status_code = 413


class InvalidInput(TrainqError):
    status_code = 422

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or [{"loc": [], "msg": message, "type": "value_error"}]

    @classmethod
    def at(cls, loc: list[str | int], message: str) -> InvalidInput:
        return cls(message, [{"loc": loc, "msg": message, "type": "value_error"}])

    @classmethod
    def of_body(cls, message: str, exc: Any) -> InvalidInput:
        """A pydantic ``ValidationError`` of a request body: each error's loc under "body"."""
        errors = [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        return cls(message, errors)


class TooManyRequests(TrainqError):
    status_code = 429

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(TrainqError):
    status_code = 503


class DatabaseUnavailable(Unavailable):
    pass


class RedisUnavailable(Unavailable):
    pass
