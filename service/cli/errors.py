"""What can go wrong talking to the trainq API, and the CLI exit code each maps to::

    ClientError                 a clear one-line message and the CLI exit code it maps to
    ├── BadSetting              TRAINQ_URL (or another client setting) is malformed: usage
    ├── Unreachable             the service cannot be reached (refused, DNS, timeout, cut off)
    │   └── NotTrainq           something answers at the URL, but not trainq's API
    └── ApiError                the service answered with an error status (``status``)
        ├── Unauthorized        401: no token, or an unknown or revoked one
        ├── Forbidden           403
        ├── NotFound            404: no such job (or not yours)
        ├── Invalid             422: the message names every field path (``train.steps: ...``)
        ├── TooLarge            413
        ├── RateLimited         429: over a submit limit; ``retry_after`` seconds (Retry-After)
        └── Unavailable         503 (and other 5xx): the database or Redis is down

An error answer's ``detail`` becomes the message: a 422 lists every ``field.path: message``
(the request's ``body.`` prefix left off, so the path is the spec's own).

trainq's API shapes every error as a JSON object ``{"detail": ...}`` (``service/api/app.py``),
so ``is_trainq_error`` tells it apart from the 404/405/501 of some other server at
``TRAINQ_URL`` (an HTML error page, say), which must not read as "job not found".
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "STATUS_ERRORS",
    "TERMINAL",
    "ApiError",
    "BadSetting",
    "ClientError",
    "Forbidden",
    "Invalid",
    "NotFound",
    "NotTrainq",
    "RateLimited",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
    "describe_error",
    "exit_code_for",
    "is_trainq_error",
]

# Exit codes of the client commands; `trainq submit --wait` gates CI on these.
EXIT_OK = 0  # the job succeeded (or the command did what it was asked)
EXIT_FAILED = 1  # the job failed (nan_loss, oom, exit_code, lost, spec_error, ...)
EXIT_USAGE = 2  # bad command line or unreadable spec file (click's own code for usage)
EXIT_CANCELLED = 3  # the job was cancelled
EXIT_TIMEOUT = 4  # the job hit max_runtime_s, or --timeout passed while waiting
EXIT_UNREACHABLE = 5  # the service cannot be reached, or answers 5xx/503
EXIT_REJECTED = 6  # the API refused the request: 400, 401, 403, 404, 409, 413, 422
EXIT_INTERRUPTED = 130  # Ctrl-C while waiting (128 + SIGINT, as a shell reports it)

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "stopped_early"})


class ClientError(Exception):
    exit_code = EXIT_REJECTED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadSetting(ClientError):
    exit_code = EXIT_USAGE


class Unreachable(ClientError):
    exit_code = EXIT_UNREACHABLE


class NotTrainq(Unreachable):
    """A server answers at the URL, but it is not trainq's API: the trainq service is not there."""


class ApiError(ClientError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Unauthorized(ApiError):
    pass


class Forbidden(ApiError):
    pass


class NotFound(ApiError):
    pass


class Invalid(ApiError):
    pass


class TooLarge(ApiError):
    pass


class RateLimited(ApiError):
    """429: over a limit; ``retry_after`` is the answer's Retry-After (seconds), if any."""

    def __init__(self, message: str, status: int, retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class Unavailable(ApiError):
    exit_code = EXIT_UNREACHABLE


def exit_code_for(status: str | None, reason: str | None) -> int:
    """The exit code for a job that ended with ``status`` and ``reason``."""
    if status == "succeeded":
        return EXIT_OK
    if status in ("cancelled", "stopped_early"):
        return EXIT_CANCELLED
    if reason == "timeout":
        return EXIT_TIMEOUT
    return EXIT_FAILED


def is_trainq_error(body: Any) -> bool:
    """Whether an error answer has the shape trainq's API gives every error (see above), or
    OpenAI's ``{"error": {"message", ...}}`` its OpenAI-compatible routes give."""
    return isinstance(body, dict) and (
        isinstance(body.get("detail"), str | list) or _openai_message(body) is not None
    )


def _openai_message(body: Any) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _field_path(loc: list[Any]) -> str:
    # The API's loc starts with where the value came from ("body", "query", "path").
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return ".".join(parts) or "(body)"


def describe_error(status: int, body: Any, what: str) -> str:
    """One line for an error answer; a 422 lists ``field.path: message`` for each error."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if status == 422 and isinstance(detail, list):
        items = []
        for err in detail:
            if isinstance(err, dict):
                loc = err.get("loc")
                path = _field_path(loc if isinstance(loc, list) else [])
                items.append(f"{path}: {err.get('msg', 'invalid')}")
        if items:
            return "invalid " + what + ": " + "; ".join(items)
    text = detail if isinstance(detail, str) else _openai_message(body)
    if status == 400 and text is not None:  # OpenAI's shape names the field in its message
        return f"invalid {what}: {text}"
    if status == 401:
        hint = "set TRAINQ_TOKEN (create one with `trainq token create --name NAME`)"
        return f"unauthorized (401): {text or 'missing or invalid token'}; {hint}"
    if status == 403:
        return f"forbidden (403): {text or 'this token may not do that'}"
    if status == 404:
        return f"not found (404): {text or what}"
    if status == 409:
        return f"conflict (409): {text or 'the request conflicts with an existing job'}"
    if status == 413:
        return f"too large (413): {text or 'the request body is over the limit'}"
    if status == 429:
        return f"too many requests (429): {text or 'over a limit'}"
    if status >= 500:
        return f"service unavailable ({status}): {text or 'try again shortly'}"
    return f"HTTP {status}: {text or what}"


STATUS_ERRORS: dict[int, type[ApiError]] = {
    400: Invalid,  # OpenAI's status for a bad parameter (the OpenAI-compatible routes)
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    413: TooLarge,
    422: Invalid,
}
