"""``POST /v1/chat/completions`` (and ``/models/{model}/v1/chat/completions``), as vLLM's
OpenAI server answers it.

The messages (roles system, user, assistant, tool; content a string or text parts) are
rendered on the worker with a chat template (``trainer.chat``: the request's
``chat_template``, else the tokenizer's, else the documented ChatML default) and then
continued as a completion. Answers ``chat.completion``, or with ``stream``
``chat.completion.chunk`` events: each choice's ``{"role": "assistant"}`` delta first, then
its content deltas, then its ``finish_reason``; with ``stream_options.include_usage`` a last
chunk with the usage and no choices. ``logprobs: true`` (and ``top_logprobs`` 0..20) gives
OpenAI's chat shape, ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
Without ``max_tokens`` (or ``max_completion_tokens``) a choice runs to EOS or the context's
end.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
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
from service.api.generation.protocol import MODEL_PATTERN, ChatRequest
from service.api.generation.responses import OPENAI_RESPONSES
from service.api.generation.service import Target, new_request, resolve, trainq_extra
from worker.genmessage import GenerateRequest

__all__ = ["chat_logprobs", "router"]

router = APIRouter(tags=["openai"])

Record = dict[str, Any]


@router.post(
    "/v1/chat/completions", responses=OPENAI_RESPONSES, openapi_extra=body_doc(ChatRequest)
)
async def chat_completions(
    request: Request, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """Chat with a job's checkpoint (``model``: the job id, or ``job_id:step``)."""
    body = await read_body(request, ChatRequest)
    name, job_id, step = model_of(body.model, None)
    return await chat(services, principal, name, job_id, step, body)


@router.post(
    "/models/{model}/v1/chat/completions",
    responses=OPENAI_RESPONSES,
    openapi_extra=body_doc(ChatRequest),
)
async def model_chat_completions(
    request: Request,
    model: Annotated[str, Path(pattern=MODEL_PATTERN)],
    services: ServicesDep,
    principal: PrincipalDep,
) -> Response:
    """``/v1/chat/completions`` under a base URL of one model (``/models/{model}``)."""
    body = await read_body(request, ChatRequest)
    name, job_id, step = model_of(body.model, model)
    return await chat(services, principal, name, job_id, step, body)


def _request(
    services: Services, principal: Principal, job_id: str, step: int | None, body: ChatRequest
) -> tuple[Target, GenerateRequest]:
    target = resolve(services, principal, job_id, step)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    request = new_request(
        services,
        principal,
        target,
        kind="chat",
        messages=messages,
        chat_template=body.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        max_tokens=body.limit(),
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stops(),
        n=body.n,
        stream=body.stream,
        logprobs=body.top(),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.bias(),
        ignore_eos=body.ignore_eos,
    )
    return target, request


async def chat(
    services: Services,
    principal: Principal,
    model: str,
    job_id: str,
    step: int | None,
    body: ChatRequest,
) -> Response:
    release = await services.inflight.take(principal.name)
    streaming = False
    try:
        target, request = await run_in_threadpool(_request, services, principal, job_id, step, body)
        fanout = Fanout(services, target, [request], 1)
        if not body.stream:
            [(start, end)] = await fanout.collect()
            return json_response(_completion(request.id, model, body, start, end))
        events = fanout.events()
        try:
            first = await anext(events)  # an error before the first event is this status
        except BaseException:
            await events.aclose()
            raise
        response = sse_response(_chunks(first, events, request.id, model, body), release)
        streaming = True
        return response
    finally:
        if not streaming:
            await release()


def chat_logprobs(records: list[Record] | None) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` of the worker's records."""
    return {
        "content": [
            {
                "token": r["token"],
                "logprob": r["logprob"],
                "bytes": r.get("bytes"),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                    for t in r.get("top") or []
                ],
            }
            for r in records or []
        ]
    }


def _completion(
    request_id: str, model: str, body: ChatRequest, start: dict[str, Any], end: dict[str, Any]
) -> dict[str, Any]:
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "logprobs": chat_logprobs(c.get("logprobs")) if body.logprobs else None,
            "finish_reason": c["finish_reason"],
            "token_ids": c["token_ids"],
        }
        for c in end["choices"]
    ]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": f"step-{start.get('step')}",
        "choices": choices,
        "usage": end.get("usage"),
        "prompt_text": end.get("prompt_text"),  # the rendered prompt (trainq's extension)
        "trainq": trainq_extra(start, end),
    }


async def _chunks(
    first: tuple[int, dict[str, Any]],
    events: AsyncGenerator[tuple[int, dict[str, Any]], None],
    request_id: str,
    model: str,
    body: ChatRequest,
) -> AsyncGenerator[bytes, None]:
    head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
            "created": now(), "model": model}  # fmt: skip
    start: dict[str, Any] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        step = start.get("step")
        return sse({**head, "system_fingerprint": f"step-{step}", "choices": choices, **extra})

    def choice(index: int, delta: dict[str, Any], finish: str | None = None,
               lps: list[Record] | None = None) -> dict[str, Any]:  # fmt: skip
        logprobs = chat_logprobs(lps) if body.logprobs and lps is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def merged() -> AsyncIterator[tuple[int, dict[str, Any]]]:
        yield first
        async for item in events:
            yield item

    try:
        async for _, event in merged():
            if event["type"] == "start":
                start = event
                roles = [choice(j, {"role": "assistant", "content": ""}) for j in range(body.n)]
                yield chunk(roles)
            elif event["type"] == "delta":
                deltas = [
                    choice(item[0], {"content": item[1]}, None, item[3] if len(item) > 3 else None)
                    for item in event["choices"]
                ]
                yield chunk(deltas)
            elif event["type"] == "end":
                done = [choice(c["index"], {}, c["finish_reason"]) for c in event["choices"]]
                yield chunk(done, trainq=trainq_extra(start, event))
                if body.include_usage():
                    yield chunk([], usage=event.get("usage"))
    finally:
        await events.aclose()
