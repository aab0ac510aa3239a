"""A small HTTP client for the trainq API, for the CLI and for scripts.

``Client()`` reads ``TRAINQ_URL`` (default ``http://127.0.0.1:8000``) and ``TRAINQ_TOKEN``
through :class:`ClientSettings`, which refuses a URL that is not ``http(s)://HOST[:PORT]``
(a usage error, before anything is sent). Every failure is one of the exceptions of
``service.cli.errors`` (re-exported here), with a one-line message and the exit code the
CLI maps it to. httpx errors are wrapped once, here, with ``raise ... from exc``. This module
imports httpx and the standard library only (never torch, Celery or SQLAlchemy), so the
client commands start fast on any machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from service.cli.errors import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    STATUS_ERRORS,
    TERMINAL,
    ApiError,
    BadSetting,
    ClientError,
    Forbidden,
    Invalid,
    NotFound,
    NotTrainq,
    RateLimited,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unreachable,
    describe_error,
    exit_code_for,
    is_trainq_error,
)

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "TERMINAL",
    "ApiError",
    "BadSetting",
    "Client",
    "ClientError",
    "ClientSettings",
    "Forbidden",
    "Invalid",
    "NotFound",
    "NotTrainq",
    "RateLimited",
    "SseEvent",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
    "exit_code_for",
    "parse_sse",
]

DEFAULT_URL = "http://127.0.0.1:8000"
# One SSE connection's read timeout when nothing bounds it sooner: longer than the server's
# keep-alive ping interval (TRAINQ_SSE_PING_S, 15 s), so only a stuck connection hits it.
SSE_READ_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
# While a followed job is queued its stream is silent; its record is read this often for the
# pending reason ("position 3 in queue gpu", "no worker serves queue gpu").
PENDING_EVERY_S = 5.0
# The name parse_sse gives a keep-alive comment when asked to yield them (no trainq stream
# sends an event of that name).
KEEPALIVE = ": keepalive"


def check_url(url: str, name: str = "TRAINQ_URL") -> str:
    """``url`` without a trailing slash, or BadSetting naming ``name`` and the fix."""
    example = f"e.g. {DEFAULT_URL}"
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or "://" not in url:
        raise BadSetting(f"{name} must start with http:// or https://, {example} (got {url!r})")
    try:
        _ = parts.port  # parsing the port is the check
    except ValueError:
        raise BadSetting(f"{name} has an invalid port, {example} (got {url!r})") from None
    if not parts.hostname:
        raise BadSetting(f"{name} names no host, {example} (got {url!r})")
    if parts.query or parts.fragment:
        raise BadSetting(f"{name} must be the API's base URL, {example} (got {url!r})")
    return url.rstrip("/")


@dataclass(frozen=True)
class ClientSettings:
    """Where the API is and who we are; the one place the client reads the environment."""

    url: str = DEFAULT_URL
    token: str | None = None

    @classmethod
    def from_env(cls) -> ClientSettings:
        """From TRAINQ_URL and TRAINQ_TOKEN; BadSetting (exit 2) for a malformed URL."""
        url = os.environ.get("TRAINQ_URL", "").strip() or DEFAULT_URL
        token = os.environ.get("TRAINQ_TOKEN", "").strip() or None
        return cls(url=check_url(url), token=token)


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: dict[str, Any]
    id: str | None = None


class Client:
    """The API's endpoints as methods returning decoded JSON (or text); ClientError on failure."""

    def __init__(
        self,
        settings: ClientSettings | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings or ClientSettings.from_env()
        headers = {"User-Agent": "trainq-cli"}
        if self.settings.token:
            headers["Authorization"] = f"Bearer {self.settings.token}"
        self._http = httpx.Client(
            base_url=self.settings.url, headers=headers, timeout=timeout, transport=transport
        )

    @property
    def url(self) -> str:
        return self.settings.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def job_url(self, job_id: str) -> str:
        return f"{self.url}{_job_path(job_id)}"

    # -- plumbing ------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.HTTPError) -> Unreachable:
        reason = str(exc) or exc.__class__.__name__
        return Unreachable(f"cannot reach the trainq service at {self.url} ({reason}); is it up?")

    def _not_trainq(self, response: httpx.Response, answered: str) -> NotTrainq:
        request = response.request
        return NotTrainq(
            f"URL {self.url} is not a trainq API ({request.method} {request.url.path} answered "
            f"{answered}); check TRAINQ_URL"
        )

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            body: Any = response.json()
        except ValueError:
            body = None
        # A route trainq has, answered in a shape trainq never uses: another server is there.
        if response.status_code in (404, 405, 501) and not is_trainq_error(body):
            raise self._not_trainq(response, f"HTTP {response.status_code}")
        message = describe_error(response.status_code, body, what)
        if response.status_code == 429:
            retry = _retry_after(response.headers.get("retry-after"))
            if retry is not None and "retry after" not in message:
                message += f"; retry after {retry:g} s"
            raise RateLimited(message, 429, retry)
        cls = STATUS_ERRORS.get(response.status_code)
        if cls is None:
            cls = Unavailable if response.status_code >= 500 else ApiError
        raise cls(message, response.status_code)

    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return self._check(response, what)

    def _json(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        response = self._request(method, path, what, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise self._not_trainq(response, "something that is not JSON") from None

    # -- endpoints -----------------------------------------------------------------------

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /v1/jobs; the job (201 new, 200 the one this key already created)."""
        headers = {"Content-Type": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        body = json.dumps(spec).encode()
        job: dict[str, Any] = self._json(
            "POST", "/v1/jobs", "job spec", content=body, headers=headers
        )
        return job

    def plan(self, spec: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs?dry_run=true: the spec validated as a submit is, and its plan
        (parameters, tokens per step, memory per device, fits); nothing is stored or sent."""
        body = json.dumps(spec).encode()
        result: dict[str, Any] = self._json(
            "POST",
            "/v1/jobs",
            "job spec",
            content=body,
            headers={"Content-Type": "application/json"},
            params={"dry_run": "true"},
        )
        return result

    def jobs(
        self,
        *,
        status: str | None = None,
        labels: list[str] | None = None,
        name: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        params: list[tuple[str, str | int]] = [("limit", limit)]
        if status:
            params.append(("status", status))
        if name:
            params.append(("name", name))
        params += [("label", label) for label in labels or ()]
        if cursor:
            params.append(("cursor", cursor))
        result: dict[str, Any] = self._json("GET", "/v1/jobs", "job filter", params=params)
        return result

    def job(self, job_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """GET /v1/jobs/{id}; ``timeout`` (seconds) bounds this one request."""
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        result: dict[str, Any] = self._json("GET", _job_path(job_id), f"job {job_id}", **extra)
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        path = _job_path(job_id, "cancel")
        result: dict[str, Any] = self._json("POST", path, f"job {job_id}")
        return result

    def delete_job(self, job_id: str) -> None:
        """DELETE /v1/jobs/{id}: a finished job, its metrics and logs (409 while it runs)."""
        self._request("DELETE", _job_path(job_id), f"job {job_id}")

    def metrics(self, job_id: str, *, max_points: int = 1000) -> dict[str, Any]:
        params = {"max_points": max_points}
        result: dict[str, Any] = self._json(
            "GET", _job_path(job_id, "metrics"), f"job {job_id}", params=params
        )
        return result

    def metrics_csv(self, job_id: str, *, max_points: int = 1000) -> str:
        params: dict[str, str | int] = {"format": "csv", "max_points": max_points}
        return self._request(
            "GET", _job_path(job_id, "metrics"), f"job {job_id}", params=params
        ).text

    def logs(self, job_id: str, *, tail: int | None = None) -> str:
        params = {} if tail is None else {"tail": tail}
        return self._request("GET", _job_path(job_id, "logs"), f"job {job_id}", params=params).text

    def follow_logs(self, job_id: str, *, tail: int | None = None) -> Iterator[str]:
        """Log text as it comes (``follow=true``); ends when the job has ended."""
        params: dict[str, str | int] = {"follow": "true"}
        if tail is not None:
            params["tail"] = tail
        # No read timeout: a quiet job sends nothing for as long as it is quiet.
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=None)
        with self._stream(job_id, "logs", params=params, timeout=timeout) as response:
            yield from response.iter_text()

    def workers(self) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", "/v1/workers", "workers")
        return result

    def queues(self) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", "/v1/queues", "queues")
        return result

    def healthz(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def events(
        self,
        job_id: str,
        *,
        last_event_id: str | None = None,
        read_timeout: float = SSE_READ_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        keepalives: bool = False,
    ) -> Generator[SseEvent, None, None]:
        """One connection to the job's SSE stream; ends when the server closes it.

        ``read_timeout`` bounds each wait for a line; the server sends a keep-alive comment
        every ping interval, so a timeout longer than that only ends a stuck connection.
        With ``keepalives``, each comment is yielded too, as an event named ``KEEPALIVE``.
        """
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(connect_timeout, read=read_timeout)
        with self._stream(job_id, "events", headers=headers, timeout=timeout) as response:
            yield from parse_sse(response.iter_lines(), keepalives=keepalives)

    @contextlib.contextmanager
    def _stream(self, job_id: str, what: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed GET of /v1/jobs/{id}/{what}: errors checked first, drops as Unreachable."""
        try:
            with self._http.stream("GET", _job_path(job_id, what), **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response, f"job {job_id}")
                yield response
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def follow_events(
        self,
        job_id: str,
        *,
        deadline: float | None = None,
        outage_s: float = 30.0,
        pending_every_s: float | None = None,
    ) -> Generator[SseEvent, None, None]:
        """The job's events until its terminal status, reconnecting with Last-Event-ID.

        ``deadline`` (a ``time.monotonic()`` value) raises TimeoutError once it passes, in
        every state: each connection's connect and read timeouts and the sleep between
        connections are bounded by the time left, and whatever arrives (an event or a
        keep-alive comment, which restarts the read timeout) is followed by a look at the
        deadline; once less is left than the connection's read timeout, it is reopened
        (from Last-Event-ID, so nothing is lost) with the time left as its read timeout.
        A queued job's stream (keep-alive comments only) cannot hold the caller past it.
        The service being unreachable for more than ``outage_s`` in a row raises Unreachable.

        With ``pending_every_s``, the job's record is read when following starts and, while
        the job is queued and its stream is quiet, at most that often; a change of its
        pending reason is yielded as a ``pending`` event (``{"status", "pending_reason"}``).
        """
        last_id: str | None = None
        down_since: float | None = None
        watch = pending_every_s is not None
        queued = watch  # not known yet: the record is read first
        reason: str | None = None
        next_read = time.monotonic()

        def left(cap: float) -> float:
            """``cap`` seconds, or what is left before the deadline; TimeoutError once past."""
            if deadline is None:
                return cap
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return min(cap, remaining)

        def check_deadline() -> None:
            left(0.0)

        while True:
            try:
                if queued and time.monotonic() >= next_read:
                    job = self.job(job_id, timeout=left(CONNECT_TIMEOUT_S))
                    down_since = None
                    next_read = time.monotonic() + (pending_every_s or 0.0)
                    queued = job.get("status") == "queued"
                    new = job.get("pending_reason") if queued else None
                    if isinstance(new, str) and new and new != reason:
                        yield SseEvent("pending", {"status": "queued", "pending_reason": new})
                    reason = new
                # A queued job's stream stays silent: wake up for the next read of its record.
                wake = next_read - time.monotonic() if queued else SSE_READ_TIMEOUT_S
                read_timeout = left(min(max(wake, 0.1), SSE_READ_TIMEOUT_S))
                connection = self.events(
                    job_id,
                    last_event_id=last_id,
                    read_timeout=read_timeout,
                    connect_timeout=left(CONNECT_TIMEOUT_S),
                    keepalives=deadline is not None,
                )
                closed = True  # by the server, as opposed to by us to read the record
                try:
                    with contextlib.closing(connection):
                        for ev in connection:
                            down_since = None
                            if ev.event == KEEPALIVE:
                                # The read timeout starts again at each comment: the next
                                # wait must not outlast the deadline.
                                if left(read_timeout) < read_timeout:
                                    closed = False
                                    break
                                continue
                            if ev.id:
                                last_id = ev.id
                            status = ev.data.get("status") if ev.event == "status" else None
                            if status is not None:
                                if watch and status == "queued" and not queued:  # a retry
                                    reason, next_read = None, time.monotonic()
                                queued = watch and status == "queued"
                            yield ev
                            if status in TERMINAL:
                                return
                            check_deadline()  # between events too
                            if queued and time.monotonic() >= next_read:
                                closed = False
                                break
                except Unreachable as exc:
                    # Only a wait we shortened ran out (the deadline is near, or the record
                    # is due): not an outage. A stuck server still fails the record's read.
                    if read_timeout >= SSE_READ_TIMEOUT_S or not _is_read_timeout(exc):
                        raise
                    check_deadline()
                    closed = False
                if not closed:
                    continue
                # The stream closed without a terminal status event: ask the record.
                if self.job(job_id, timeout=left(CONNECT_TIMEOUT_S)).get("status") in TERMINAL:
                    return
            except NotTrainq:
                raise
            except (Unreachable, Unavailable):
                check_deadline()  # a timeout at the deadline is the deadline, not an outage
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > outage_s:
                    raise
            time.sleep(left(1.0))


def _job_path(job_id: str, *rest: str) -> str:
    """/v1/jobs/{id}[/...]: the id quoted as one path segment, whatever was typed."""
    return "/".join(("/v1/jobs", quote(job_id, safe=""), *rest))


def _retry_after(value: str | None) -> float | None:
    """A Retry-After of delta-seconds (trainq's form); None if absent or not that."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 86400 else None


def _is_read_timeout(exc: BaseException) -> bool:
    return isinstance(exc.__cause__, httpx.ReadTimeout)


def parse_sse(lines: Iterator[str], *, keepalives: bool = False) -> Iterator[SseEvent]:
    """Server-Sent Events framing: ``id:``, ``event:``, ``data:``; a blank line dispatches.
    A comment (``: ping``) is skipped, or with ``keepalives`` yielded as ``KEEPALIVE``."""
    event, entry_id = "message", None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    payload = {"text": "\n".join(data)}
                if not isinstance(payload, dict):
                    payload = {"value": payload}
                yield SseEvent(event, payload, entry_id)
            event, data, entry_id = "message", [], None
            continue
        if line.startswith(":"):
            if keepalives:
                yield SseEvent(KEEPALIVE, {})
            continue  # a keep-alive comment
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            entry_id = value
