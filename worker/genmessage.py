"""The generation wire between the API and the workers (Redis streams), and its bounds.

Light on purpose, like ``worker.message``: no torch, no celery, no redis. The API builds a
``GenerateRequest`` and appends it to the request stream of the job's queue; one worker
serving that queue takes it (consumer group ``generate``), generates, and appends events to
the request's own reply stream, which the API reads and relays.

Keys (``prefix`` defaults to ``trainq``); nothing a user typed is in them:

- ``{prefix}:gen:{broker queue}``  requests for one queue (``worker.message.broker_queue``,
  so the queue name sits under the prefix as the Celery queues do), ``MAXLEN ~``
- ``{prefix}:gen:reply:{request id}``  one request's events, with a TTL; the id is 32 hex
  digits the API made
- ``{prefix}:gen:cancel:{request id}``  set by the API when its client went away; the
  worker stops that request at its next token

A request is of one ``kind``: ``complete`` (a prompt, as text or token ids, continued),
``chat`` (``messages`` rendered with the model's chat template, then continued), ``tokenize``
(``prompt`` text to ids) or ``detokenize`` (``prompt_ids`` to text).

Reply events (JSON in field ``e``), in order: ``start`` (the worker's registry name, step,
load time, whether the model was already loaded, prompt tokens, the prompt's ids, how many
requests decode together), ``delta`` per decoding step when streaming, then
``end`` (the choices, finish reasons, usage) or, at any point instead, ``error`` (an HTTP
status, a one-line message and the field it is about, if any).

A token's log-probability record (``logprobs`` of a choice, ``prompt_logprobs`` with
``echo``) is ``{"id", "token", "bytes", "logprob", "offset", "top"}``: ``token`` the
token's own text (``"bytes:\\xNN"`` escapes where its bytes are not UTF-8 alone, as OpenAI
writes them), ``bytes`` its raw bytes, ``logprob`` the log-softmax of the model's raw logits
(before temperature, penalties and biases) in float32, ``offset`` the character offset of
the token in the choice's text (with ``echo``, in prompt text + text), ``top`` the
``logprobs`` most likely tokens as ``{"id", "token", "bytes", "logprob"}``, most likely first.
The first prompt token's record is ``null`` (nothing precedes it).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.message import broker_queue

__all__ = [
    "FIELD",
    "GROUP",
    "LIMITS",
    "GenerateRequest",
    "cancel_key",
    "decode_event",
    "encode_event",
    "error_event",
    "reply_stream",
    "request_stream",
]

GROUP = "generate"
FIELD = "e"  # the one field of every entry: a JSON document
REQUEST_ID = r"^[0-9a-f]{32}$"


class Limits:
    """Bounds of every generation parameter (the API answers 422 beyond them)."""

    max_tokens = 4096
    n = 16
    prompt_chars = 256 * 1024
    prompt_ids = 131_072
    token_id = 1_048_576  # the largest vocab a spec allows
    stop_strings = 4
    stop_chars = 256
    temperature = 2.0
    top_k = 1_048_576
    seed = 2**63 - 1
    logprobs = 20  # top alternatives per token, as OpenAI's chat API allows
    penalty = 2.0  # presence/frequency penalties lie in [-penalty, penalty]
    logit_bias = 300  # entries
    bias = 100.0  # each bias lies in [-bias, bias]
    messages = 256
    message_chars = 256 * 1024
    template_chars = 64 * 1024


LIMITS = Limits()


def request_stream(queue: str, prefix: str = "trainq") -> str:
    """Requests for trainq queue ``queue`` (a name QUEUE_PATTERN allows)."""
    return f"{prefix}:gen:{broker_queue(queue, prefix)}"


def _request_id(request_id: str) -> str:
    if len(request_id) != 32 or any(c not in "0123456789abcdef" for c in request_id):
        raise ValueError("a request id is 32 lowercase hex digits")
    return request_id


def reply_stream(request_id: str, prefix: str = "trainq") -> str:
    """One request's events; ``request_id`` is 32 hex digits the service made."""
    return f"{prefix}:gen:reply:{_request_id(request_id)}"


def cancel_key(request_id: str, prefix: str = "trainq") -> str:
    """Set when the request's client went away."""
    return f"{prefix}:gen:cancel:{_request_id(request_id)}"


class GenerateRequest(BaseModel):
    """One generation request as the worker receives it (validated again on arrival)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=REQUEST_ID)
    job_id: str = Field(pattern=r"^[0-9a-f]{1,32}$")
    # A hash of the requesting owner (never the name): the worker serves owners in turn.
    owner: str = Field("", pattern=r"^[0-9a-f]{0,64}$")
    step: int | None = Field(None, ge=0)  # None: the newest complete checkpoint
    kind: Literal["complete", "chat", "tokenize", "detokenize"] = "complete"
    prompt: str | None = Field(None, max_length=LIMITS.prompt_chars)
    prompt_ids: list[int] | None = Field(None, max_length=LIMITS.prompt_ids)
    # kind "chat": [{"role", "content"}] as the API validated them, rendered on the worker with
    # the model's chat template (``chat_template`` overrides it; trainer.chat renders it).
    messages: list[dict[str, str]] | None = Field(None, max_length=LIMITS.messages)
    chat_template: str | None = Field(None, max_length=LIMITS.template_chars)
    add_generation_prompt: bool = True
    # kind "tokenize": add the tokenizer's special tokens (bos) as the model's own encode does
    add_special_tokens: bool = True
    max_tokens: int = Field(16, ge=0, le=LIMITS.max_tokens)  # 0 only with echo
    temperature: float = Field(1.0, ge=0, le=LIMITS.temperature)
    top_k: int = Field(0, ge=0, le=LIMITS.top_k)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=LIMITS.seed)
    stop: list[str] = Field(default_factory=list, max_length=LIMITS.stop_strings)
    n: int = Field(1, ge=1, le=LIMITS.n)
    stream: bool = False
    # None: no log-probabilities; k >= 0: each token's own and its k most likely alternatives
    logprobs: int | None = Field(None, ge=0, le=LIMITS.logprobs)
    echo: bool = False  # the prompt's own log-probabilities (``prompt_logprobs`` in ``end``)
    presence_penalty: float = Field(0.0, ge=-LIMITS.penalty, le=LIMITS.penalty)
    frequency_penalty: float = Field(0.0, ge=-LIMITS.penalty, le=LIMITS.penalty)
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=LIMITS.logit_bias)
    ignore_eos: bool = False  # vLLM's: go on past the tokenizer's end-of-sequence token
    deadline: float  # Unix time: past it the worker stops and answers 504

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if self.kind == "chat":
            if self.messages is None or self.prompt is not None or self.prompt_ids is not None:
                raise ValueError("a chat request carries messages and no prompt")
        elif (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("a request carries exactly one of prompt or prompt_ids")
        if self.max_tokens == 0 and not self.echo and self.kind in ("complete", "chat"):
            raise ValueError("max_tokens 0 asks for nothing without echo")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < LIMITS.token_id or abs(bias) > LIMITS.bias:
                raise ValueError(f"logit_bias {token}: {bias} is out of bounds")
        return self

    def to_entry(self) -> dict[str, str]:
        return {FIELD: self.model_dump_json()}

    @classmethod
    def from_entry(cls, fields: dict[Any, Any]) -> GenerateRequest:
        raw = fields.get(FIELD) or fields.get(FIELD.encode())
        if raw is None:
            raise ValueError("a request entry has no payload")
        return cls.model_validate_json(raw)


EventType = Literal["start", "delta", "end", "error"]


def error_event(status: int, message: str, loc: list[str | int] | None = None) -> dict[str, Any]:
    return {"type": "error", "status": status, "message": message, "loc": loc}


def encode_event(event: dict[str, Any]) -> dict[str, str]:
    return {FIELD: json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


def decode_event(fields: dict[Any, Any]) -> dict[str, Any]:
    raw = fields.get(FIELD) or fields.get(FIELD.encode())
    if raw is None:
        raise ValueError("a reply entry has no payload")
    event = json.loads(raw)
    if not isinstance(event, dict) or "type" not in event:
        raise ValueError("a reply entry is not an event")
    return event
