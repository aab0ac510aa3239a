"""``POST /v1/completions`` (and ``/models/{model}/v1/completions``, a base URL per model,
and ``POST /v1/jobs/{id}/generate``, the job in the path), as vLLM's OpenAI server answers it.

A list of prompts (text or token ids, up to ``MAX_PROMPTS``) is one worker request per
prompt, sent concurrently (the worker batches what waits together); the answer's choices are
ordered prompt by prompt, ``index = prompt_i * n + j``, and its usage is their sum.

``logprobs`` k (0..20) gives OpenAI's completions shape: ``tokens``, ``token_logprobs``,
``top_logprobs`` (the k most likely, and the chosen token, as ``{token: logprob}``) and
``text_offset``. ``echo`` puts the prompt first in each choice's text, and its tokens first
in the logprobs (the first one's log-probability null: nothing precedes it); with
``max_tokens`` 0 the answer is the prompt alone: lm-eval's loglikelihood requests. Log-
probabilities are the model's own (log-softmax of the raw logits), before temperature,
penalties and biases. Streamed with ``echo``, a choice's prompt and completion arrive as
one chunk when the choice is done (the worker answers the prompt's log-probabilities at
the end).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.inputs import JobId
from service.api.generation.edge import (
    body_doc,
    json_response,
    model_of,
    now,
    read_body,
    sse,
    sse_response,
)
from service.api.generation.fanout import Fanout
from service.api.generation.protocol import (
    MODEL_PATTERN,
    CompletionRequest,
    GenerateBody,
)
from service.api.generation.responses import OPENAI_RESPONSES, RESPONSES
from service.api.generation.service import (
    Target,
    check_length,
    new_request,
    resolve,
    trainq_extra,
)
from worker.genmessage import GenerateRequest

__all__ = ["completion_logprobs", "router"]

router = APIRouter(tags=["openai"])
jobs_router = APIRouter(tags=["generate"])

Record = dict[str, Any]


@router.post(
    "/v1/completions", responses=OPENAI_RESPONSES, openapi_extra=body_doc(CompletionRequest)
)
async def completions(request: Request, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Generate from a job's checkpoint: ``model`` is the job id (its newest checkpoint) or
    ``job_id:step``. OpenAI's completions API: prompt (text, token ids, or a list of
    either), max_tokens, temperature (0: greedy), top_p, top_k, seed, stop, n, stream,
    logprobs, echo, presence_penalty, frequency_penalty, logit_bias."""
    body = await read_body(request, CompletionRequest)
    name, job_id, step = model_of(body.model, None)
    return await complete(services, principal, name, job_id, step, body)


@router.post(
    "/models/{model}/v1/completions",
    responses=OPENAI_RESPONSES,
    openapi_extra=body_doc(CompletionRequest),
)
async def model_completions(
    request: Request,
    model: Annotated[str, Path(pattern=MODEL_PATTERN)],
    services: ServicesDep,
    principal: PrincipalDep,
) -> Response:
    """``/v1/completions`` under a base URL of one model (``/models/{model}``), where
    lm-eval's remote tokenizer finds ``/tokenize``, ``/detokenize`` and
    ``/tokenizer_info`` for it too."""
    body = await read_body(request, CompletionRequest)
    name, job_id, step = model_of(body.model, model)
    return await complete(services, principal, name, job_id, step, body)


@jobs_router.post(
    "/v1/jobs/{job_id}/generate", responses=RESPONSES, openapi_extra=body_doc(GenerateBody)
)
async def generate(
    request: Request,
    job_id: JobId,
    services: ServicesDep,
    principal: PrincipalDep,
    step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> Response:
    """``/v1/completions`` with the job in the path (``?step=N`` for an older checkpoint);
    its errors keep trainq's ``{"detail": ...}``."""
    body = await read_body(request, GenerateBody)
    return await complete(services, principal, job_id, job_id, step, body)


def _requests(
    services: Services, principal: Principal, job_id: str, step: int | None, body: GenerateBody
) -> tuple[Target, list[GenerateRequest]]:
    """Every check the API can make (404, 409, 422), then one request per prompt."""
    target = resolve(services, principal, job_id, step)
    out = []
    for loc, text, ids in body.prompts():
        check_length(services, target, text, ids, loc)
        out.append(
            new_request(
                services,
                principal,
                target,
                kind="complete",
                prompt=text,
                prompt_ids=ids,
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stops(),
                n=body.n,
                # with echo the prompt's log-probabilities come at the end: not streamed
                stream=body.stream and not body.echo,
                logprobs=body.logprobs,
                echo=body.echo,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=body.bias(),
                ignore_eos=body.ignore_eos,
            )
        )
    return target, out


async def complete(
    services: Services,
    principal: Principal,
    model: str,
    job_id: str,
    step: int | None,
    body: GenerateBody,
) -> Response:
    release = await services.inflight.take(principal.name)  # one slot a call (inflight.py)
    streaming = False
    try:
        target, requests = await run_in_threadpool(
            _requests, services, principal, job_id, step, body
        )
        locs = [loc for loc, _, _ in body.prompts()]
        fanout = Fanout(services, target, requests, services.settings.generate_fanout, locs)
        if not body.stream:
            return json_response(_completion(requests[0].id, model, body, await fanout.collect()))
        events = fanout.events()
        try:
            first = await anext(events)  # an error before the first event is this status
        except BaseException:
            await events.aclose()
            raise
        response = sse_response(_chunks(first, events, requests[0].id, model, body), release)
        streaming = True  # the stream gives its slots back when it ends
        return response
    finally:
        if not streaming:
            await release()


# --------------------------------------------------------------------------- the answers


def _first_text(records: list[Record | None], text: str, i: int) -> str:
    """The text of a token without a record (the prompt's first): up to the next token."""
    nxt = next((r["offset"] for r in records[i + 1 :] if r is not None), len(text))
    start = 0 if i == 0 else (records[i - 1] or {}).get("offset", 0)
    return text[start:nxt]


def completion_logprobs(
    records: list[Record] | None, prompt: list[Record | None] | None = None, prompt_text: str = ""
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` of the worker's records (``prompt``: the echoed
    prompt's, first)."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for i, rec in enumerate(prompt or []):
        if rec is None:  # nothing precedes it
            out["tokens"].append(_first_text(prompt or [], prompt_text, i))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(0)
        else:
            _add(out, rec)
    for rec in records or []:
        _add(out, rec)
    return out


def _add(out: dict[str, list[Any]], rec: Record) -> None:
    out["tokens"].append(rec["token"])
    out["token_logprobs"].append(rec["logprob"])
    top = {t["token"]: t["logprob"] for t in rec.get("top") or []}
    top.setdefault(rec["token"], rec["logprob"])
    out["top_logprobs"].append(top)
    out["text_offset"].append(rec.get("offset", 0))


def _choice(k: int, body: GenerateBody, end: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    prompt_text = str(end.get("prompt_text") or "")
    logprobs = None
    if body.logprobs is not None:
        prompt = end.get("prompt_logprobs") if body.echo else None
        logprobs = completion_logprobs(c.get("logprobs"), prompt, prompt_text)
    return {
        "index": k * body.n + c["index"],
        "text": (prompt_text + c["text"]) if body.echo else c["text"],
        "logprobs": logprobs,
        "finish_reason": c["finish_reason"],
        "token_ids": c["token_ids"],
    }


def _usage(ends: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {key: sum(int((e.get("usage") or {}).get(key) or 0) for e in ends) for key in keys}


def _completion(
    request_id: str,
    model: str,
    body: GenerateBody,
    results: list[tuple[dict[str, Any], dict[str, Any]]],
) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object, plus ``token_ids`` per choice and ``trainq``
    (the checkpoint's step, the model's load time, whether it was loaded already)."""
    start, end = results[0]
    choices = [_choice(k, body, e, c) for k, (_, e) in enumerate(results) for c in e["choices"]]
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": f"step-{start.get('step')}",
        "choices": choices,
        "usage": _usage([e for _, e in results]),
        "trainq": trainq_extra(start, end),
    }


async def _chunks(
    first: tuple[int, dict[str, Any]],
    events: AsyncGenerator[tuple[int, dict[str, Any]], None],
    request_id: str,
    model: str,
    body: GenerateBody,
) -> AsyncGenerator[bytes, None]:
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": now(),
            "model": model}  # fmt: skip
    ends: list[dict[str, Any]] = []
    start: dict[str, Any] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        step = start.get("step")
        return sse({**head, "system_fingerprint": f"step-{step}", "choices": choices, **extra})

    async def merged() -> AsyncIterator[tuple[int, dict[str, Any]]]:
        yield first
        async for item in events:
            yield item

    try:
        async for k, event in merged():
            if event["type"] == "start":
                start = start or event
            elif event["type"] == "delta":
                yield chunk([_delta(k, body, item) for item in event["choices"]])
            elif event["type"] == "end":
                ends.append(event)
                if body.echo:  # not streamed by the worker: the whole choice now
                    yield chunk([{**_choice(k, body, event, c), "finish_reason": None}
                                 for c in event["choices"]])  # fmt: skip
                done = [_finish(k, body, c) for c in event["choices"]]
                yield chunk(done, trainq=trainq_extra(start, event))
        if body.include_usage():
            yield chunk([], usage=_usage(ends))
    finally:
        await events.aclose()


def _delta(k: int, body: GenerateBody, item: list[Any]) -> dict[str, Any]:
    index, text, ids = item[0], item[1], item[2]
    lps = item[3] if len(item) > 3 else None
    logprobs = completion_logprobs(lps) if body.logprobs is not None and lps is not None else None
    return {"index": k * body.n + index, "text": text, "logprobs": logprobs,
            "finish_reason": None, "token_ids": ids}  # fmt: skip


def _finish(k: int, body: GenerateBody, c: dict[str, Any]) -> dict[str, Any]:
    return {"index": k * body.n + c["index"], "text": "", "logprobs": None,
            "finish_reason": c["finish_reason"], "token_ids": []}  # fmt: skip
