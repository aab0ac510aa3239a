"""Chat messages rendered to a prompt with a chat template, as ``transformers``'
``apply_chat_template`` renders them: a Jinja2 template in a sandbox
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``), given ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``, with ``raise_exception(msg)``
and the ``tojson`` filter as Hugging Face templates use them.

Which template (the worker's ``_chat_prompt``): the request's ``chat_template`` (vLLM's
field), else the tokenizer's own (``chat_template`` of the dataset's tokenizer), else
``DEFAULT_TEMPLATE``, ChatML::

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

(each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; with
``add_generation_prompt``, ``<|im_start|>assistant\\n`` last). For a byte-level or other
tokenizer without these as special tokens, the markers are plain text the model learns like
any other.

A template that fails (a syntax error, ``raise_exception``, the sandbox refusing an
attribute) raises ``ChatTemplateError`` with one line saying why.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplateError", "render"]

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template cannot render these messages; one line."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)  # fmt: skip


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render(
    template: str | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt ``template`` (``DEFAULT_TEMPLATE`` when None) makes of ``messages``."""
    from jinja2 import TemplateError

    compiled = _compile(template if template is not None else DEFAULT_TEMPLATE)
    try:
        return str(
            compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token or "",
                eos_token=eos_token or "",
            )
        )
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ChatTemplateError(f"the chat template failed: {first}") from None
