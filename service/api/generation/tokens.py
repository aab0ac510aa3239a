"""vLLM's tokenizer routes, answered by a worker with the model's own tokenizer (the API
loads none):

- ``POST /tokenize`` ``{model, prompt, add_special_tokens}`` -> ``{tokens, count,
  max_model_len}`` (and ``token_strs`` with ``return_token_strs``)
- ``POST /detokenize`` ``{model, tokens}`` -> ``{prompt}``
- ``GET /tokenizer_info?model=`` -> ``{eos_token, bos_token, pad_token, chat_template,
  model_max_length, tokenizer_class}`` (what lm-eval's ``RemoteTokenizer`` reads)

lm-eval's ``tokenizer_backend="remote"`` calls these at its base URL without a ``model``; so
each is also served under ``/models/{model}/`` (with ``/models/{model}/v1/completions``): a
base URL of one model, ``base_url=http://HOST/models/JOB/v1/completions``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import InvalidInput
from service.api.generation.edge import body_doc, json_response, model_of, read_body
from service.api.generation.fanout import Fanout
from service.api.generation.protocol import MODEL_PATTERN, DetokenizeRequest, TokenizeRequest
from service.api.generation.responses import OPENAI_RESPONSES
from service.api.generation.service import new_request, resolve

__all__ = ["router"]

router = APIRouter(tags=["openai"])

PathModel = Annotated[str, Path(pattern=MODEL_PATTERN)]
QueryModel = Annotated[str | None, Query(pattern=MODEL_PATTERN)]


async def _ask(
    services: Services, principal: Principal, model: str | None, path: str | None,
    **fields: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """One worker request of the named model; its (start, end) events."""
    _, job_id, step = model_of(model, path)
    release = await services.inflight.take(principal.name)
    try:
        target = await run_in_threadpool(resolve, services, principal, job_id, step)
        request = new_request(services, principal, target, **fields)
        [(start, end)] = await Fanout(services, target, [request], 1).collect()
        return start, end
    finally:
        await release()


async def _tokenize(
    request: Request, services: Services, principal: Principal, path: str | None
) -> Response:
    body = await read_body(request, TokenizeRequest)
    _, end = await _ask(services, principal, body.model, path, kind="tokenize",
                        prompt=body.prompt, add_special_tokens=body.add_special_tokens)  # fmt: skip
    out: dict[str, Any] = {
        "count": end.get("count", len(end.get("tokens") or [])),
        "max_model_len": end.get("max_model_len"),
        "tokens": end.get("tokens") or [],
    }
    if body.return_token_strs:
        out["token_strs"] = end.get("token_strs")
    return json_response(out)


async def _detokenize(
    request: Request, services: Services, principal: Principal, path: str | None
) -> Response:
    body = await read_body(request, DetokenizeRequest)
    try:
        _, end = await _ask(services, principal, body.model, path, kind="detokenize",
                            prompt_ids=list(body.tokens))  # fmt: skip
    except InvalidInput as exc:  # the worker's words for the field the body calls "tokens"
        for error in exc.errors:
            if list(error.get("loc") or [])[:2] == ["body", "prompt_ids"]:
                error["loc"] = ["body", "tokens", *error["loc"][2:]]
        raise
    return json_response({"prompt": end.get("prompt", "")})


async def _info(
    services: Services, principal: Principal, model: str | None, path: str | None
) -> Response:
    start, end = await _ask(services, principal, model, path, kind="tokenize", prompt="a",
                            add_special_tokens=False)  # fmt: skip
    info = end.get("tokenizer") or {}
    text = {k: v if isinstance(v, str) else None for k, v in info.items()}
    return json_response({
        "tokenizer_class": "trainq",
        "eos_token": text.get("eos_token"),
        "bos_token": text.get("bos_token"),
        "pad_token": text.get("pad_token"),
        # the template /v1/chat/completions renders with (the tokenizer's, else the default)
        "chat_template": text.get("chat_template"),
        "model_max_length": start.get("context"),
    })  # fmt: skip


@router.post("/tokenize", responses=OPENAI_RESPONSES, openapi_extra=body_doc(TokenizeRequest))
async def tokenize(request: Request, services: ServicesDep, principal: PrincipalDep) -> Response:
    """The model's tokenizer on ``prompt`` (vLLM's route)."""
    return await _tokenize(request, services, principal, None)


@router.post("/models/{model}/tokenize", responses=OPENAI_RESPONSES,
             openapi_extra=body_doc(TokenizeRequest))  # fmt: skip
async def model_tokenize(
    request: Request, model: PathModel, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """``/tokenize`` under a base URL of one model."""
    return await _tokenize(request, services, principal, model)


@router.post("/detokenize", responses=OPENAI_RESPONSES, openapi_extra=body_doc(DetokenizeRequest))
async def detokenize(request: Request, services: ServicesDep, principal: PrincipalDep) -> Response:
    """The text of ``tokens`` (vLLM's route)."""
    return await _detokenize(request, services, principal, None)


@router.post("/models/{model}/detokenize", responses=OPENAI_RESPONSES,
             openapi_extra=body_doc(DetokenizeRequest))  # fmt: skip
async def model_detokenize(
    request: Request, model: PathModel, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """``/detokenize`` under a base URL of one model."""
    return await _detokenize(request, services, principal, model)


@router.get("/tokenizer_info", responses=OPENAI_RESPONSES)
async def tokenizer_info(
    services: ServicesDep, principal: PrincipalDep, model: QueryModel = None
) -> Response:
    """The tokenizer's special tokens and context (vLLM's route; ``?model=``)."""
    return await _info(services, principal, model, None)


@router.get("/models/{model}/tokenizer_info", responses=OPENAI_RESPONSES)
async def model_tokenizer_info(
    model: PathModel, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """``/tokenizer_info`` under a base URL of one model."""
    return await _info(services, principal, None, model)
