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
attribute or a range, recursion too deep) raises ``ChatTemplateError`` with one line saying
why. The sandbox bounds no CPU or memory: a template a tenant sent is rendered by
``trainer.chat_sandbox`` in a child process with a time and memory limit.

Training on conversations (``trainer.sft``) needs to know which characters the assistant
said: :func:`render_spans` renders a whole conversation (no generation prompt) and returns
each assistant message's character span, the text that carries loss:

- a template that marks them with ``{% generation %}`` ... ``{% endgeneration %}`` gives
  the marked spans, as transformers' ``return_assistant_tokens_mask`` takes them (the k-th
  block is the k-th assistant message; a template marking another number of blocks is a
  ``ChatTemplateError``);
- a template without markers (``DEFAULT_TEMPLATE`` among them) is rendered prefix by
  prefix: assistant message ``i``'s span is what ``messages[:i+1]`` (no generation prompt)
  adds to ``messages[:i]`` with the generation prompt, i.e. the content and the template's
  end of turn (``Hello.<|im_end|>\n`` in ChatML), so the model also learns to stop. Each
  render must begin with the one before (``ChatTemplateError`` otherwise: mark the turns).

``render`` (serving: the chat completions route) accepts the tag too and renders its body
as is, as ``apply_chat_template`` does, so a template written for training serves unchanged.
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from typing import Any

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplateError", "render", "render_spans"]

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

    # {% generation %} is always known: serving renders a template that marks the answers
    # for training as transformers does, the tag's body as is (recorded only in render_spans).
    extensions: list[Any] = [loopcontrols, _generation_extension()]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template)
    except (TemplateError, RecursionError, ValueError, TypeError, ArithmeticError) as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render(
    template: str | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt ``template`` (``DEFAULT_TEMPLATE`` when None) makes of ``messages``."""
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
    except Exception as exc:  # a sandbox refusal, a range too big, recursion too deep, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ChatTemplateError(f"the chat template failed: {first}") from None


# -- assistant spans, for training (trainer.sft) ----------------------------------------------

_MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _Tracking(threading.local):
    """What a ``render_spans`` in progress has rendered so far, and the marked spans."""

    blocks: list[str] | None = None
    spans: list[tuple[int, int]]


_TRACK = _Tracking()


@lru_cache(maxsize=1)
def _generation_extension() -> Any:
    """The ``{% generation %}`` tag as transformers' ``AssistantTracker`` defines it: its
    body renders as is, and while ``render_spans`` runs, where it landed is recorded."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation_support")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation_support(self, caller: Any) -> str:
            text = str(caller())
            blocks = _TRACK.blocks
            if blocks is not None:
                start = sum(len(b) for b in blocks)
                _TRACK.spans.append((start, start + len(text)))
            return text

    return Generation


def _marked_spans(
    template: str, messages: list[dict[str, Any]], bos_token: str, eos_token: str
) -> tuple[str, list[tuple[int, int]]]:
    compiled = _compile(template)
    blocks: list[str] = []
    _TRACK.blocks, _TRACK.spans = blocks, []
    try:
        for block in compiled.generate(
            messages=messages, add_generation_prompt=False,
            bos_token=bos_token or "", eos_token=eos_token or "",
        ):  # fmt: skip
            blocks.append(block)
        return "".join(blocks), list(_TRACK.spans)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a sandbox refusal, a range too big, recursion too deep, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ChatTemplateError(f"the chat template failed: {first}") from None
    finally:
        _TRACK.blocks, _TRACK.spans = None, []


def _prefix_spans(
    template: str | None, messages: list[dict[str, Any]], bos_token: str, eos_token: str
) -> tuple[str, list[tuple[int, int]]]:
    text = render(template, messages, False, bos_token, eos_token)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(template, messages[:i], True, bos_token, eos_token)
        turn = render(template, messages[: i + 1], False, bos_token, eos_token)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise ChatTemplateError(
                "the chat template does not render a conversation prefix by prefix, so its"
                " assistant turns cannot be told apart; mark them with {% generation %}"
                " ... {% endgeneration %}"
            )
        spans.append((len(prompt), len(turn)))
    return text, spans


def render_spans(
    template: str | None,
    messages: list[dict[str, Any]],
    bos_token: str = "",
    eos_token: str = "",
) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation rendered (no generation prompt), and the character span
    ``(start, end)`` of each assistant message in it, in order (the module's rules)."""
    chosen = template if template is not None else DEFAULT_TEMPLATE
    assistants = sum(1 for m in messages if m.get("role") == "assistant")
    if not _MARKED.search(chosen):
        return _prefix_spans(chosen, messages, bos_token, eos_token)
    text, spans = _marked_spans(chosen, messages, bos_token, eos_token)
    if len(spans) != assistants:
        raise ChatTemplateError(
            f"the chat template marks {len(spans)} {{% generation %}} block(s) for"
            f" {assistants} assistant message(s); it must mark each assistant message once"
        )
    return text, spans
