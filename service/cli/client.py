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
from collections.abc import Generator, Iterable, Iterator
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
from service.cli.follow import (
    CONNECT_TIMEOUT_S,
    SSE_READ_TIMEOUT_S,
    SseEvent,
    follow_events,
    parse_sse,
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
    "Download",
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
    "check_url",
    "exit_code_for",
    "parse_sse",
]

DEFAULT_URL = "http://127.0.0.1:8000"
# While a followed job is queued its stream is silent; its record is read this often for the
# pending reason ("position 3 in queue gpu", "no worker serves queue gpu").
PENDING_EVERY_S = 5.0


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

    def submit_sweep(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/sweeps; the new sweep."""
        found: dict[str, Any] = self._json("POST", "/v1/sweeps", "sweep", json=body)
        return found

    def sweeps(self, limit: int = 50) -> list[dict[str, Any]]:
        """GET /v1/sweeps: the caller's sweeps, newest first."""
        found = self._json("GET", "/v1/sweeps", "sweeps", params={"limit": limit})
        return list(found["items"])

    def sweep(self, sweep_id: str, *, cancel: bool = False) -> dict[str, Any]:
        """GET /v1/sweeps/{id}, or with ``cancel`` POST its cancel; the sweep and its trials."""
        path = f"/v1/sweeps/{quote(sweep_id, safe='')}"
        if cancel:
            return dict(self._json("POST", f"{path}/cancel", f"sweep {sweep_id}"))
        return dict(self._json("GET", path, f"sweep {sweep_id}"))

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
        with self._stream(
            "GET", _job_path(job_id, "logs"), f"job {job_id}", params=params, timeout=timeout
        ) as response:
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
        with self._stream(
            "GET", _job_path(job_id, "events"), f"job {job_id}", headers=headers, timeout=timeout
        ) as response:
            yield from parse_sse(response.iter_lines(), keepalives=keepalives)

    def follow_events(
        self,
        job_id: str,
        *,
        deadline: float | None = None,
        outage_s: float = 30.0,
        pending_every_s: float | None = None,
    ) -> Generator[SseEvent, None, None]:
        """The job's events until its terminal status (``service.cli.follow.follow_events``:
        reconnects with Last-Event-ID; ``deadline`` raises TimeoutError; an outage longer
        than ``outage_s`` raises Unreachable; ``pending_every_s`` yields ``pending`` events)."""
        return follow_events(
            self, job_id, deadline=deadline, outage_s=outage_s, pending_every_s=pending_every_s
        )

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}/checkpoints: the job's complete checkpoints."""
        path = _job_path(job_id, "checkpoints")
        result: dict[str, Any] = self._json("GET", path, f"job {job_id}")
        return result

    @contextlib.contextmanager
    def download(
        self, job_id: str, step: str, fmt: str, *, read_timeout: float
    ) -> Iterator[Download]:
        """GET /v1/jobs/{id}/checkpoints/{step}/download?format=fmt, streamed: the archive's
        announced size and step, and its bytes as they come (a drop: Unreachable)."""
        path = _job_path(job_id, "checkpoints", quote(step, safe=""), "download")
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=read_timeout)
        with self._stream(
            "GET", path, f"job {job_id}", params={"format": fmt}, timeout=timeout
        ) as response:
            yield Download(
                size=_int_header(response, "content-length"),
                step=_int_header(response, "x-trainq-step"),
                chunks=self._chunks(response.iter_bytes()),
            )

    # -- datasets ------------------------------------------------------------------------

    def upload_dataset(
        self, params: dict[str, Any], content: Iterable[bytes], size: int
    ) -> dict[str, Any]:
        """POST /v1/datasets with ``content`` streamed as the body (``size`` bytes); the
        dataset. An exception ``content`` raises (a local check refusing a chunk) goes
        through as it is."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        name = params.get("name")
        try:
            response = self._http.post(
                "/v1/datasets",
                params=params,
                content=content,
                headers=headers,
                timeout=httpx.Timeout(30.0, read=300.0),
            )
        except (httpx.WriteError, httpx.RemoteProtocolError) as exc:
            # The server answered early (a refusal) and closed the connection while we sent.
            raise ApiError(
                f"the server closed the connection during the upload ({exc}); it refused the"
                f" upload or stopped: `trainq data show {name}` tells which",
                400,
            ) from None
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        result: dict[str, Any] = self._check(response, f"dataset {name}").json()
        return result

    def datasets(self) -> dict[str, Any]:
        """GET /v1/datasets: yours (an admin token: everyone's)."""
        result: dict[str, Any] = self._json("GET", "/v1/datasets", "datasets")
        return result

    def dataset(self, name: str, *, owner: str | None = None) -> dict[str, Any]:
        """GET /v1/datasets/{name} (``owner``: an admin reads another's)."""
        params = {"owner": owner} if owner else {}
        path = _dataset_path(name)
        result: dict[str, Any] = self._json("GET", path, f"dataset {name}", params=params)
        return result

    def delete_dataset(self, name: str, *, owner: str | None = None) -> None:
        """DELETE /v1/datasets/{name}: it and its folder (409 while a job uses it)."""
        params = {"owner": owner} if owner else {}
        self._request("DELETE", _dataset_path(name), f"dataset {name}", params=params)

    # -- generation ----------------------------------------------------------------------

    def complete(self, body: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
        """POST /v1/completions: the whole answer (OpenAI's completion object)."""
        what = f"job {body.get('model')}"
        result: dict[str, Any] = self._json(
            "POST", "/v1/completions", what, json=body, timeout=timeout
        )
        return result

    def stream_completion(
        self, body: dict[str, Any], *, read_timeout: float = 600.0
    ) -> Iterator[str]:
        """POST /v1/completions with ``stream``: each choice's text as it comes; an error
        the server sends mid-stream raises Unavailable."""
        what = f"job {body.get('model')}"
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=read_timeout)
        with self._stream(
            "POST", "/v1/completions", what, json={**body, "stream": True}, timeout=timeout
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise Unavailable(str(chunk["error"].get("message")), 504)
                for choice in chunk.get("choices") or ():
                    yield choice.get("text") or ""

    # -- streaming plumbing --------------------------------------------------------------

    @contextlib.contextmanager
    def _stream(self, method: str, path: str, what: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed request: errors checked first, drops as Unreachable."""
        try:
            with self._http.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response, what)
                yield response
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def _chunks(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks``, with a dropped connection raised as Unreachable where it happens."""
        try:
            yield from chunks
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc


@dataclass(frozen=True)
class Download:
    """A checkpoint archive as it streams in: ``size`` and ``step`` as the server announced
    them (-1: not announced), ``chunks`` its bytes."""

    size: int
    step: int
    chunks: Iterator[bytes]


def _int_header(response: httpx.Response, name: str) -> int:
    try:
        return int(response.headers.get(name, "-1"))
    except ValueError:
        return -1


def _dataset_path(name: str) -> str:
    return f"/v1/datasets/{quote(name, safe='')}"


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
