"""The request bodies of the OpenAI-compatible routes, as vLLM's OpenAI server takes them
(``vllm/entrypoints/openai/protocol.py``): OpenAI's names and defaults, plus vLLM's
extensions trainq serves (``top_k``, ``ignore_eos``, ``chat_template``,
``add_generation_prompt``). Every bound is ``worker.genmessage.LIMITS``'s; a value past one
is a 400 naming the field (``service.api.generation.openai_errors``).

A field whose name OpenAI has but trainq does not serve (``suffix``, ``tools``, ...) is
refused as an unknown parameter rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.api.core.errors import InvalidInput
from worker.genmessage import LIMITS

__all__ = [
    "MAX_PROMPTS",
    "MODEL_PATTERN",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerateBody",
    "Sampling",
    "TokenizeRequest",
]

MODEL_PATTERN = r"^[0-9a-f]{1,32}(:[0-9]{1,10})?$"
MAX_PROMPTS = 64  # prompts in one completions call (one worker request each)
# sequences one completions call asks for (prompts x n): what one call may cost the workers
MAX_SEQUENCES = 256

TokenId = Annotated[int, Field(ge=0, lt=LIMITS.token_id)]
PromptText = Annotated[str, StringConstraints(max_length=LIMITS.prompt_chars)]
PromptIds = Annotated[list[TokenId], Field(max_length=LIMITS.prompt_ids)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=LIMITS.stop_chars)]
Penalty = Annotated[float, Field(ge=-LIMITS.penalty, le=LIMITS.penalty)]
Bias = Annotated[float, Field(ge=-LIMITS.bias, le=LIMITS.bias)]
ModelId = Annotated[str, StringConstraints(pattern=MODEL_PATTERN)]


class Sampling(BaseModel):
    """What completions and chat share: OpenAI's sampling parameters (``top_k`` and
    ``ignore_eos`` are vLLM's extensions). ``stream`` answers Server-Sent Events as OpenAI
    streams them (``data: {...}``, ``data: [DONE]``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(1.0, ge=0, le=LIMITS.temperature)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=LIMITS.top_k, description="0: off (vLLM's extension)")
    seed: int | None = Field(None, ge=0, le=LIMITS.seed)
    stop: StopString | Annotated[list[StopString], Field(max_length=LIMITS.stop_strings)] | None = (
        None
    )
    n: int = Field(1, ge=1, le=LIMITS.n)
    stream: bool = False
    # OpenAI's {"include_usage": true}: a last chunk with the usage and no choices.
    stream_options: dict[Literal["include_usage"], bool] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # {"token id": bias}, the id as a string as JSON keys are (OpenAI's logit_bias)
    logit_bias: (
        Annotated[
            dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,7}$")], Bias],
            Field(max_length=LIMITS.logit_bias),
        ]
        | None
    ) = None
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _bias_ids(self) -> Sampling:
        for key in self.logit_bias or {}:
            if int(key) >= LIMITS.token_id:
                raise InvalidInput.at(
                    ["body", "logit_bias"], f"token id {key} is past the largest vocabulary"
                )
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class GenerateBody(Sampling):
    """OpenAI's completions body without ``model`` (``/v1/jobs/{id}/generate``)."""

    prompt: (
        PromptText
        | PromptIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description=f"text or token ids, or a list of up to {MAX_PROMPTS} of either")
    max_tokens: int = Field(16, ge=0, le=LIMITS.max_tokens, description="0 only with echo")
    # top-k alternatives per token (and each token's own log-probability); None: none
    logprobs: int | None = Field(None, ge=0, le=LIMITS.logprobs)
    echo: bool = False  # the prompt first in each choice's text (and its logprobs)
    best_of: int | None = Field(None, ge=1, le=LIMITS.n)

    @model_validator(mode="after")
    def _supported(self) -> GenerateBody:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidInput.at(["body", "best_of"], "best_of must equal n (or be left out)")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidInput.at(
                ["body", "max_tokens"], "max_tokens 0 asks for nothing without echo"
            )
        p: Any = self.prompt
        count = len(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else 1
        if count * self.n > MAX_SEQUENCES:
            raise InvalidInput.at(
                ["body", "n"],
                f"{count} prompts x n {self.n} is {count * self.n} sequences; one call may ask "
                f"for {MAX_SEQUENCES}",
            )
        return self

    def prompts(self) -> list[tuple[list[str | int], str | None, list[int] | None]]:
        """Each prompt as (its loc, text, token ids), exactly one of the two set;
        InvalidInput for an empty one, naming it (``prompt[2]``)."""
        p: Any = self.prompt
        many = isinstance(p, list) and bool(p) and isinstance(p[0], str | list)
        items = list(p) if many else [p]
        out: list[tuple[list[str | int], str | None, list[int] | None]] = []
        for i, item in enumerate(items):
            loc: list[str | int] = ["body", "prompt", i] if many else ["body", "prompt"]
            if not item:
                raise InvalidInput.at(loc, "the prompt is empty")
            out.append((loc, item, None) if isinstance(item, str) else (loc, None, list(item)))
        return out


class CompletionRequest(GenerateBody):
    """``POST /v1/completions``: ``model`` is a job id (its newest checkpoint) or
    ``job:step`` (``GET /v1/models`` lists them)."""

    model: ModelId | None = Field(None, description="a job id, or job_id:step")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=LIMITS.message_chars)]


class ChatMessage(BaseModel):
    """One message: its role and its content, a string or a list of text parts (joined
    with newlines, as vLLM does). ``name`` and ``tool_call_id`` are taken and not used."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: (
        Annotated[str, StringConstraints(max_length=LIMITS.message_chars)]
        | Annotated[list[TextPart], Field(max_length=64)]
        | None
    ) = None
    name: str | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``: OpenAI's body (``max_completion_tokens`` is the newer
    name of ``max_tokens``; without either, generation runs to the context's end or
    EOS), plus vLLM's ``chat_template`` and ``add_generation_prompt``."""

    model: ModelId | None = Field(None, description="a job id, or job_id:step")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=LIMITS.messages)]
    max_tokens: int | None = Field(None, ge=1, le=LIMITS.max_tokens)
    max_completion_tokens: int | None = Field(None, ge=1, le=LIMITS.max_tokens)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=LIMITS.logprobs)
    chat_template: str | None = Field(None, max_length=LIMITS.template_chars)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _chat(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInput.at(["body", "top_logprobs"], "top_logprobs needs logprobs: true")
        total = sum(len(m.text()) for m in self.messages)
        if total > LIMITS.prompt_chars:
            raise InvalidInput.at(
                ["body", "messages"],
                f"the messages hold {total} characters, over {LIMITS.prompt_chars}",
            )
        return self

    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or LIMITS.max_tokens

    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: ``{model, prompt, add_special_tokens}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: ModelId | None = None
    prompt: Annotated[str, StringConstraints(max_length=LIMITS.prompt_chars)]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: ``{model, tokens}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: ModelId | None = None
    tokens: Annotated[list[TokenId], Field(max_length=LIMITS.prompt_ids)]
