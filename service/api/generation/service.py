"""Generation requests: OpenAI's completions body, the checks the API makes before a worker
sees it, and the relay of the worker's reply stream (the wire: ``worker.genmessage``).

The API never loads torch or a tokenizer: it checks what it can from SQL and the shared
folders (the job is the caller's, has a complete checkpoint, its queue has a live worker; a
prompt of token ids, or of text for a byte-level dataset, fits the context), sends the
request to the job's queue, and relays the events. The worker checks again what only it can
(the tokenized prompt's length, whether the checkpoint loads) and answers with an error
event carrying the HTTP status, which becomes this request's answer.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, model_validator
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
from service.api.generation.inflight import GRACE_S
from service.api.scheduling.ratelimit import owner_hash
from trainer.config import AnyModelConfig, ConfigError, resolve_data_path
from trainer.tokenizer import BYTE, TokenizerError, dataset_tokenizer
from worker.genmessage import (
    LIMITS,
    GenerateRequest,
    cancel_key,
    decode_event,
    reply_stream,
    request_stream,
)

__all__ = [
    "CompletionRequest",
    "GatewayTimeout",
    "GenerateBody",
    "Relay",
    "WorkerLost",
    "prepare",
]

MODEL_PATTERN = r"^[0-9a-f]{1,32}(:[0-9]{1,10})?$"
REQUEST_STREAM_MAXLEN = 10_000
LIVENESS_S = 1.0  # how often a relay looks whether its worker is still in the registry

TokenId = Annotated[int, Field(ge=0, lt=LIMITS.token_id)]
PromptText = Annotated[str, StringConstraints(max_length=LIMITS.prompt_chars)]
PromptIds = Annotated[list[TokenId], Field(max_length=LIMITS.prompt_ids)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=LIMITS.stop_chars)]


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


class GenerateBody(BaseModel):
    """The sampling parameters (OpenAI's names; ``top_k`` is an extension). ``stream``
    answers Server-Sent Events as OpenAI streams them (``data: {...}``, ``data: [DONE]``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: (
        PromptText
        | PromptIds
        | Annotated[list[PromptText], Field(max_length=1)]
        | Annotated[list[PromptIds], Field(max_length=1)]
    ) = Field(description="text or token ids (or a list of one of those: a batch of one)")
    max_tokens: int = Field(16, ge=1, le=LIMITS.max_tokens)
    temperature: float = Field(1.0, ge=0, le=LIMITS.temperature)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=LIMITS.top_k, description="0: off (an extension of OpenAI's)")
    seed: int | None = Field(None, ge=0, le=LIMITS.seed)
    stop: StopString | Annotated[list[StopString], Field(max_length=LIMITS.stop_strings)] | None = (
        None
    )
    n: int = Field(1, ge=1, le=LIMITS.n)
    stream: bool = False
    # OpenAI's {"include_usage": true}: a last chunk with the usage and no choices.
    stream_options: dict[Literal["include_usage"], bool] | None = None
    # OpenAI's fields that only their defaults are supported for (any other value: 422).
    echo: bool = False
    logprobs: None = None
    best_of: int | None = Field(None, ge=1, le=LIMITS.n)
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _supported(self) -> GenerateBody:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be left out)")
        return self

    def prompt_parts(self) -> tuple[str | None, list[int] | None]:
        """(text, token ids): exactly one is set; InvalidInput for an empty prompt."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            p = p[0]  # OpenAI's batch of one
        if isinstance(p, str):
            if not p:
                raise InvalidInput.at(["body", "prompt"], "the prompt is empty")
            return p, None
        if not p:
            raise InvalidInput.at(["body", "prompt"], "the prompt is empty")
        return None, list(p)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerateBody):
    """``POST /v1/completions``: ``model`` is a job id (its newest checkpoint) or
    ``job:step``."""

    model: str = Field(pattern=MODEL_PATTERN, description="a job id, or job_id:step")


_MODEL: TypeAdapter[AnyModelConfig] = TypeAdapter(AnyModelConfig)


@dataclass(frozen=True)
class Target:
    job_id: str
    step: int | None
    queue: str
    seq_len: int


def parse_model(model: str) -> tuple[str, int | None]:
    job_id, _, step = model.partition(":")
    return job_id, (int(step) if step else None)


def _steps(runs_root: Path, job_id: str) -> list[int]:
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


def prepare(
    services: Services,
    principal: Principal,
    job_id: str,
    step: int | None,
    body: GenerateBody,
) -> tuple[Target, GenerateRequest]:
    """Every check the API can make (404, 409, 422), then the request to send."""
    with services.reader.connect() as conn:
        stmt = select(JOBS.c.queue, JOBS.c.train, JOBS.c.status).where(JOBS.c.id == job_id)
        if not principal.admin:
            stmt = stmt.where(JOBS.c.owner == principal.name)
        row = conn.execute(stmt).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    queue, train, status = row
    model = _MODEL.validate_python((train or {}).get("model") or {})
    seq_len = int(model.seq_len)
    steps = _steps(services.settings.runs_root, job_id)
    if not steps:
        raise Conflict(f"job {job_id} ({status}) has no complete checkpoint yet")
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps[-10:]))
        raise NotFound(f"job {job_id} has no checkpoint at step {step} (it has {have})")
    text, ids = body.prompt_parts()
    length = len(ids) if ids is not None else _byte_length(services, train, text)
    if length is not None and length > seq_len:
        raise InvalidInput.at(
            ["body", "prompt"], f"the prompt is {length} tokens; the model's context is {seq_len}"
        )
    timeout = services.settings.generate_timeout_s
    request = GenerateRequest(
        id=secrets.token_hex(16),
        job_id=job_id,
        owner=owner_hash(principal.name),
        step=step,
        prompt=text,
        prompt_ids=ids,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stops(),
        n=body.n,
        stream=body.stream,
        deadline=time.time() + timeout,
    )
    return Target(job_id, step, queue, seq_len), request


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
    """Sends one request to its queue and reads its reply stream until ``end`` or ``error``;
    past the deadline (plus a grace) a GatewayTimeout, never a hang."""

    def __init__(self, services: Services, target: Target, request: GenerateRequest) -> None:
        self.services = services
        self.target = target
        self.request = request
        prefix = services.settings.redis_prefix
        self.reply = reply_stream(request.id, prefix)
        self.cancel = cancel_key(request.id, prefix)
        self.cursor = "0-0"
        self.done = False

    async def send(self) -> None:
        workers = await self.services.alive_workers()
        queue = self.target.queue
        if not any(queue in (w.get("queues") or ()) and not w.get("draining") for w in workers):
            raise Unavailable(f"no live worker serves queue {queue}; generation runs on one")
        try:
            await self.services.aredis.xadd(
                request_stream(queue, self.services.settings.redis_prefix),
                self.request.to_entry(),
                maxlen=REQUEST_STREAM_MAXLEN,
                approximate=True,
            )
        except RedisError as exc:
            raise _redis_lost(exc) from exc

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The worker's events in order; raises the answer of an error event, of a timeout,
        of the worker leaving the registry (WorkerLost) or of Redis failing (503)."""
        try:
            async for event in self._events():
                yield event
        except RedisError as exc:
            self.done = True
            raise _redis_lost(exc) from exc

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        aredis = self.services.aredis
        # Blocks no longer than the liveness period, so a lost worker is seen between reads.
        block_ms = int(min(self.services.settings.sse_ping_s, LIVENESS_S) * 1000)
        ends_at = self.request.deadline + GRACE_S
        worker: str | None = None  # known from the start event (an older worker omits it)
        looked = time.monotonic()
        while True:
            left = ends_at - time.time()
            if left <= 0:
                self.done = True
                raise GatewayTimeout(
                    f"no answer from a worker of queue {self.target.queue} within "
                    f"{self.services.settings.generate_timeout_s:g} s (TRAINQ_GENERATE_TIMEOUT_S)"
                )
            if worker is not None and time.monotonic() - looked >= LIVENESS_S:
                looked = time.monotonic()
                await self._check_alive(worker)
            block = max(1, min(block_ms, int(left * 1000)))
            got = await aredis.xread({self.reply: self.cursor}, count=100, block=block)
            for _, entries in got or ():
                for entry_id, fields in entries:
                    self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    event = decode_event(fields)
                    if event["type"] == "error":
                        self.done = True
                        raise _error(event)
                    if event["type"] == "start" and isinstance(event.get("worker"), str):
                        worker = event["worker"]
                    if event["type"] == "end":
                        self.done = True
                    yield event
                    if self.done:
                        return

    async def _check_alive(self, worker: str) -> None:
        """WorkerLost once ``worker`` is no longer a live registry entry: it has not beaten
        for ``TRAINQ_WORKER_STALE_S`` (a kill), or it removed its entry (a shutdown that did
        not answer)."""
        live = await self.services.alive_workers()
        if any(w.get("name") == worker for w in live):
            return
        self.done = True
        stale = self.services.settings.worker_stale_s
        raise WorkerLost(
            f"worker {worker} stopped during the generation (not seen in the worker registry "
            f"for {stale:g} s, TRAINQ_WORKER_STALE_S); try again"
        )

    async def close(self) -> None:
        """Drop the reply stream; if the answer was not complete, tell the worker to stop."""
        aredis = self.services.aredis
        try:
            if not self.done:
                ttl = int(self.services.settings.generate_timeout_s) + 60
                await aredis.set(self.cancel, b"1", ex=ttl)
            await aredis.delete(self.reply)
        except Exception:  # Redis away: the stream's TTL removes it
            pass


def _redis_lost(exc: RedisError) -> RedisUnavailable:
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


def completion_json(
    request_id: str, model: str, start: dict[str, Any], end: dict[str, Any]
) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object, plus ``token_ids`` per choice and ``trainq``
    (the checkpoint's step, the model's load time, whether it was loaded already)."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"step-{start.get('step')}",
        "choices": [
            {
                "index": c["index"],
                "text": c["text"],
                "logprobs": None,
                "finish_reason": c["finish_reason"],
                "token_ids": c["token_ids"],
            }
            for c in end["choices"]
        ],
        "usage": end["usage"],
        "trainq": trainq_extra(start, end),
    }


def trainq_extra(start: dict[str, Any], end: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {k: start.get(k) for k in ("step", "load_s", "cached")}
    if end is not None:
        out["generate_s"] = end.get("generate_s")
        out["seed"] = end.get("seed")
    return out


def sse_chunk(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
