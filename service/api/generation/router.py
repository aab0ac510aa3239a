"""Generation routes: the OpenAI-compatible surface, as vLLM's OpenAI server defines it
(``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``; the last five also under
``/models/{model}/``, a base URL of one model), and ``POST /v1/jobs/{id}/generate`` (the
completions API with the job in the path).

Generation runs on a worker serving the job's queue, not here (service.api.generation.service
relays it). Answers: 200 (the object, or with ``stream`` Server-Sent Events as OpenAI sends
them, ending with ``data: [DONE]``); 404 a job that is not the caller's or an unknown step;
409 a job without a complete checkpoint, or one that cannot be loaded; 400 (422 on
``/v1/jobs/{id}/generate``) a parameter out of bounds or a prompt longer than the context;
429 over ``TRAINQ_GENERATE_MAX_PER_OWNER``; 502 the worker that took the request left the
registry (``TRAINQ_WORKER_STALE_S`` without a beat: killed or cut off); 503 no live worker
on the queue, or Redis unreachable; 504 the generation deadline
(``TRAINQ_GENERATE_TIMEOUT_S``). Errors on the OpenAI routes are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (``openai_errors``); once a stream has
started, a later error arrives as ``data: {"error": {...}}`` and the stream ends without
``[DONE]``.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.api.generation import chat, completions, models, tokens

__all__ = ["router"]

router = APIRouter()
router.include_router(models.router)
router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(tokens.router)
router.include_router(completions.jobs_router)
