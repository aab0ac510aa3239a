"""A small HTTP client for the trainq API, for the CLI and for scripts.

``Client()`` reads ``TRAINQ_URL`` (default ``http://127.0.0.1:8000``) and ``TRAINQ_TOKEN``
through :class:`ClientSettings`. Every failure is one of the exceptions of
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from service.cli.errors import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    STATUS_ERRORS,
    TERMINAL,
    ApiError,
    ClientError,
    Forbidden,
    Invalid,
    NotFound,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unreachable,
    describe_error,
    exit_code_for,
)

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "TERMINAL",
    "ApiError",
    "Client",
    "ClientError",
    "ClientSettings",
    "Forbidden",
    "Invalid",
    "NotFound",
    "SseEvent",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
    "exit_code_for",
    "parse_sse",
]

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class ClientSettings:
    """Where the API is and who we are; the one place the client reads the environment."""

    url: str = DEFAULT_URL
    token: str | None = None

    @classmethod
    def from_env(cls) -> ClientSettings:
        url = os.environ.get("TRAINQ_URL", "").strip() or DEFAULT_URL
        token = os.environ.get("TRAINQ_TOKEN", "").strip() or None
        return cls(url=url.rstrip("/"), token=token)


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
        return f"{self.url}/v1/jobs/{job_id}"

    # -- plumbing ------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.HTTPError) -> Unreachable:
        reason = str(exc) or exc.__class__.__name__
        return Unreachable(f"cannot reach the trainq service at {self.url} ({reason}); is it up?")

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            body: Any = response.json()
        except ValueError:
            body = None
        message = describe_error(response.status_code, body, what)
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
        except ValueError as exc:
            raise ApiError(
                f"{self.url} answered {what} with something that is not JSON; is it trainq?",
                response.status_code,
            ) from exc

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

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{job_id}", f"job {job_id}")
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job_id}/cancel", f"job {job_id}")
        return result

    def metrics(self, job_id: str, *, max_points: int = 1000) -> dict[str, Any]:
        params = {"max_points": max_points}
        result: dict[str, Any] = self._json(
            "GET", f"/v1/jobs/{job_id}/metrics", f"job {job_id}", params=params
        )
        return result

    def metrics_csv(self, job_id: str, *, max_points: int = 1000) -> str:
        params: dict[str, str | int] = {"format": "csv", "max_points": max_points}
        return self._request(
            "GET", f"/v1/jobs/{job_id}/metrics", f"job {job_id}", params=params
        ).text

    def logs(self, job_id: str, *, tail: int | None = None) -> str:
        params = {} if tail is None else {"tail": tail}
        return self._request("GET", f"/v1/jobs/{job_id}/logs", f"job {job_id}", params=params).text

    def follow_logs(self, job_id: str, *, tail: int | None = None) -> Iterator[str]:
        """Log text as it comes (``follow=true``); ends when the job has ended."""
        params: dict[str, str | int] = {"follow": "true"}
        if tail is not None:
            params["tail"] = tail
        # No read timeout: a quiet job sends nothing for as long as it is quiet.
        timeout = httpx.Timeout(10.0, read=None)
        with self._stream(job_id, "logs", params=params, timeout=timeout) as response:
            yield from response.iter_text()

    def workers(self) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", "/v1/workers", "workers")
        return result

    def healthz(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def events(
        self, job_id: str, *, last_event_id: str | None = None, read_timeout: float = 60.0
    ) -> Iterator[SseEvent]:
        """One connection to the job's SSE stream; ends when the server closes it.

        ``read_timeout`` must be longer than the server's keep-alive ping interval.
        """
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(10.0, read=read_timeout)
        with self._stream(job_id, "events", headers=headers, timeout=timeout) as response:
            yield from parse_sse(response.iter_lines())

    @contextlib.contextmanager
    def _stream(self, job_id: str, what: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed GET of /v1/jobs/{id}/{what}: errors checked first, drops as Unreachable."""
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/{what}", **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response, f"job {job_id}")
                yield response
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def follow_events(
        self, job_id: str, *, deadline: float | None = None, outage_s: float = 30.0
    ) -> Iterator[SseEvent]:
        """The job's events until its terminal status, reconnecting with Last-Event-ID.

        The service being unreachable for more than ``outage_s`` in a row raises Unreachable;
        ``deadline`` (a ``time.monotonic()`` value) raises TimeoutError when it passes.
        """
        last_id: str | None = None
        down_since: float | None = None
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            try:
                for ev in self.events(job_id, last_event_id=last_id):
                    down_since = None
                    if ev.id:
                        last_id = ev.id
                    yield ev
                    if ev.event == "status" and ev.data.get("status") in TERMINAL:
                        return
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError
                # The stream closed without a terminal status event: ask the record.
                if self.job(job_id).get("status") in TERMINAL:
                    return
            except (Unreachable, Unavailable):
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > outage_s:
                    raise
            time.sleep(1.0)


def parse_sse(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Server-Sent Events framing: ``id:``, ``event:``, ``data:``; a blank line dispatches."""
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
            continue  # a keep-alive comment
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            entry_id = value
