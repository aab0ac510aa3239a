"""Generation requests: the checks the API makes before a worker sees one, and the relay
of the worker's reply stream (the wire: ``worker.genmessage``).

The API never loads torch or a tokenizer: it checks what it can from SQL and the shared
folders (the job is the caller's, has a complete checkpoint, its queue has a live worker; a
prompt of token ids, or of text for a byte-level dataset, fits the context), sends the
request to the job's queue, and relays the events. The worker checks again what only it can
(the tokenized prompt's length, whether the checkpoint loads) and answers with an error
event carrying the HTTP status, which becomes this request's answer.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from redis import RedisError
from sqlalchemy import select

from service.api.checkpoints.files import checkpoints_dir, complete_steps
from service.api.core.auth import Principal
from service.api.core.deps import Services
from service.api.core.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    RedisUnavailable,
    TrainqError,
    Unavailable,
)
from service.api.core.models import JOBS
from service.api.scheduling.ratelimit import owner_hash
from trainer.config import AnyModelConfig, ConfigError, resolve_data_path
from trainer.tokenizer import BYTE, TokenizerError, dataset_tokenizer
from worker.genmessage import (
    GenerateRequest,
    cancel_key,
    decode_event,
    reply_stream,
)

__all__ = [
    "REQUEST_STREAM_MAXLEN",
    "GatewayTimeout",
    "Relay",
    "Target",
    "WorkerLost",
    "check_length",
    "check_served",
    "checkpoint_steps",
    "new_request",
    "parse_model",
    "redis_lost",
    "resolve",
    "seq_len_of",
]

REQUEST_STREAM_MAXLEN = 10_000
LIVENESS_S = 1.0  # how often a relay looks whether its worker is still in the registry


class GatewayTimeout(TrainqError):
    status_code = 504


class WorkerLost(TrainqError):
    """The worker that took the request left the registry (killed, or cut off from Redis)
    before it answered: the request fails now rather than at its deadline."""

    status_code = 502


class WorkerError(TrainqError):
    """An error event of the worker, answered with the status it carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status if 400 <= status < 600 else 500


_MODEL: TypeAdapter[AnyModelConfig] = TypeAdapter(AnyModelConfig)


@dataclass(frozen=True)
class Target:
    job_id: str
    step: int | None
    queue: str
    seq_len: int
    train: dict[str, Any]


def seq_len_of(train: dict[str, Any] | None) -> int:
    """The context of a job's model (``train.model.seq_len``)."""
    return int(_MODEL.validate_python((train or {}).get("model") or {}).seq_len)


def parse_model(model: str) -> tuple[str, int | None]:
    job_id, _, step = model.partition(":")
    return job_id, (int(step) if step else None)


def checkpoint_steps(runs_root: Path, job_id: str) -> list[int]:
    """Complete checkpoints' steps, read as the checkpoint routes read them: no link is
    followed (a run folder, checkpoints folder or step-N that is a link counts as none)."""
    ck_fd = checkpoints_dir(runs_root, job_id)
    if ck_fd is None:
        return []
    try:
        return complete_steps(ck_fd)
    except OSError:
        return []
    finally:
        os.close(ck_fd)


def resolve(services: Services, principal: Principal, job_id: str, step: int | None) -> Target:
    """The caller's job and checkpoint (404 not theirs or no such step, 409 none yet)."""
    with services.reader.connect() as conn:
        stmt = select(JOBS.c.queue, JOBS.c.train, JOBS.c.status).where(JOBS.c.id == job_id)
        if not principal.admin:
            stmt = stmt.where(JOBS.c.owner == principal.name)
        row = conn.execute(stmt).first()
    if row is None:
        raise NotFound(f"model {job_id} not found (no job of yours has this id)")
    queue, train, status = row
    steps = checkpoint_steps(services.settings.runs_root, job_id)
    if not steps:
        raise Conflict(f"job {job_id} ({status}) has no complete checkpoint yet")
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps[-10:]))
        raise NotFound(f"job {job_id} has no checkpoint at step {step} (it has {have})")
    return Target(job_id, step, queue, seq_len_of(train), train or {})


def check_length(
    services: Services, target: Target, text: str | None, ids: list[int] | None, loc: list[Any]
) -> None:
    """422 for a prompt longer than the context, where the API can count it (token ids, or
    text of a byte-level dataset); the worker checks the rest."""
    length = len(ids) if ids is not None else _byte_length(services, target.train, text)
    if length is not None and length > target.seq_len:
        raise InvalidInput.at(
            loc, f"the prompt is {length} tokens; the model's context is {target.seq_len}"
        )


def new_request(
    services: Services, principal: Principal, target: Target, **fields: Any
) -> GenerateRequest:
    """A request to ``target`` (a fresh id, the owner's hash, the deadline); ``fields`` are
    GenerateRequest's."""
    timeout = services.settings.generate_timeout_s
    try:
        return GenerateRequest(
            id=secrets.token_hex(16),
            job_id=target.job_id,
            owner=owner_hash(principal.name),
            step=target.step,
            deadline=time.time() + timeout,
            **fields,
        )
    except ValidationError as exc:  # the body's checks missed a bound: still the field's 422
        raise InvalidInput.of_body("invalid generation request", exc) from exc


def _byte_length(services: Services, train: dict[str, Any], text: str | None) -> int | None:
    """A text prompt's token count when the job's dataset is byte-level (no tokenizer.json
    beside its shards); None when only the worker's tokenizer can tell."""
    try:
        data = train.get("data") or {}
        folder = resolve_data_path(
            str(data.get("path", "")),
            services.settings.data_root,
            dataset=data.get("dataset"),  # the job's own frozen dataset (trainer.paths)
        )
    except ConfigError:
        return None
    try:
        if text is None or dataset_tokenizer(folder) != BYTE:
            return None
    except TokenizerError:
        return None  # the worker answers why
    return len(text.encode("utf-8"))


class Relay:
    """One request's place on the wire: its reply stream and cancel key, its read cursor,
    the worker that took it and whether its answer is complete. ``Relays`` (fanout.py)
    sends a call's requests and reads their replies together."""

    def __init__(self, services: Services, target: Target, request: GenerateRequest) -> None:
        self.services = services
        self.target = target
        self.request = request
        prefix = services.settings.redis_prefix
        self.reply = reply_stream(request.id, prefix)
        self.cancel = cancel_key(request.id, prefix)
        self.cursor = "0-0"
        self.done = False
        self.worker: str | None = None  # known from the start event (an older worker omits it)

    def take(self, entry_id: Any, fields: dict[Any, Any]) -> dict[str, Any]:
        """The event of one reply entry; raises the answer of an error event."""
        self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        event = decode_event(fields)
        if event["type"] == "error":
            self.done = True
            raise _error(event)
        if event["type"] == "start" and isinstance(event.get("worker"), str):
            self.worker = event["worker"]
        if event["type"] == "end":
            self.done = True
        return event

    def lost(self, live: list[dict[str, Any]]) -> WorkerLost | None:
        """WorkerLost once the worker that took the request is no longer a live registry
        entry (``live``): it has not beaten for ``TRAINQ_WORKER_STALE_S`` (a kill), or it
        removed its entry (a shutdown that did not answer)."""
        if self.worker is None or any(w.get("name") == self.worker for w in live):
            return None
        self.done = True
        stale = self.services.settings.worker_stale_s
        return WorkerLost(
            f"worker {self.worker} stopped during the generation (not seen in the worker "
            f"registry for {stale:g} s, TRAINQ_WORKER_STALE_S); try again"
        )

    def timeout(self) -> GatewayTimeout:
        self.done = True
        return GatewayTimeout(
            f"no answer from a worker of queue {self.target.queue} within "
            f"{self.services.settings.generate_timeout_s:g} s (TRAINQ_GENERATE_TIMEOUT_S)"
        )


async def check_served(services: Services, queue: str) -> None:
    """503 unless a live, not draining worker serves ``queue``. The registry is cached for
    a second; a "no" is asked again fresh, so a worker that has just registered is not
    refused for the cache's age."""

    def served(workers: list[dict[str, Any]]) -> bool:
        return any(queue in (w.get("queues") or ()) and not w.get("draining") for w in workers)

    if not served(await services.alive_workers()) and not served(
        await services.alive_workers(max_age_s=0)
    ):
        raise Unavailable(f"no live worker serves queue {queue}; generation runs on one")


def redis_lost(exc: RedisError) -> RedisUnavailable:
    return RedisUnavailable(
        f"Redis became unreachable during the generation ({type(exc).__name__}); try again"
    )


def _error(event: dict[str, Any]) -> TrainqError:
    status = int(event.get("status") or 500)
    message = str(event.get("message") or "generation failed")
    if status == 422:
        loc = event.get("loc") or ["body"]
        return InvalidInput(message, [{"loc": loc, "msg": message, "type": "value_error"}])
    return WorkerError(status, message)


def trainq_extra(start: dict[str, Any], end: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {k: start.get(k) for k in ("step", "load_s", "cached")}
    if end is not None:
        out["generate_s"] = end.get("generate_s")
        out["seed"] = end.get("seed")
    return out
