"""Chat and instruction data: checked line by line, rendered, tokenized, with a loss mask.

Two JSON Lines formats, one example a line (blank lines are skipped):

- ``chat``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str,
  "weight"?: 0|1}, ...]}`` (OpenAI's fine-tuning format). Rendered with the tokenizer's
  chat template (``tokenizer_config.json``'s ``chat_template``) or ``trainer.chat``'s
  ``DEFAULT_TEMPLATE`` (ChatML, the chat endpoint's default), by ``trainer.chat.render_spans``.
- ``completion``: ``{"prompt": str, "completion": str}``: the text is ``prompt +
  completion``, then the tokenizer's ``eos_token`` when it has one.

**Which tokens carry loss** (the mask, 1 = a target): a token whose first character lies in
an assistant message's span (``render_spans``: the ``{% generation %}`` blocks, or for a
template without them the content and the end of turn), except the spans of assistant
messages with ``"weight": 0``; for ``completion``, the completion and the eos token. With
``train_on_inputs`` every token does. Byte-level: each UTF-8 byte of a character has its
character's mask.

**Checks** (`check_line`, in ``trainer.sft_lines``: the API and the CLI check uploads with
it), each a reason code with the line number: ``not_utf8``,
``malformed_json``, ``bad_shape`` (not the format's object, a field of the wrong type),
``unknown_role``, ``empty_content``, ``bad_weight`` (not 0 or 1, or not on an assistant
message), ``no_assistant_turn``; and at preparation ``template_error`` (the chat template
refused the conversation). Such a line makes the whole dataset bad: the first
``MAX_PROBLEMS`` are listed with their line numbers. An example longer than ``max_len``
tokens after templating is dropped (``overlong="drop"``, reason ``too_long``) or cut to its
first ``max_len`` tokens (``"truncate"``); the report counts both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from trainer.chat import ChatTemplateError, render_spans
from trainer.data import pack_rows
from trainer.sft_lines import (
    MAX_PROBLEMS,
    ROLES,
    SFT_FORMATS,
    LineError,
    Problems,
    check_line,
    read_lines,
)

__all__ = [
    "MAX_PROBLEMS",
    "OVERLONG",
    "ROLES",
    "SFT_FORMATS",
    "Example",
    "LineError",
    "Problems",
    "SftReport",
    "build_examples",
    "check_line",
    "encode_example",
    "packing_efficiency",
    "read_lines",
]

OVERLONG = ("drop", "truncate")


class Tokens(Protocol):
    """What tokenizes: text to ids with each token's first character."""

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...


class ByteTokens:
    """Byte-level: each UTF-8 byte a token; its character is the one it belongs to."""

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        raw = text.encode("utf-8")
        sizes = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
        starts = np.repeat(np.arange(len(text), dtype=np.int64), sizes)
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16), starts


@dataclass(frozen=True)
class Template:
    """The chat template and special tokens of the tokenizer (None: the default)."""

    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""


@dataclass
class Example:
    ids: np.ndarray  # uint16
    mask: np.ndarray  # uint8, 1 = a target


def _text_and_spans(
    fmt: str, example: dict[str, Any], template: Template
) -> tuple[str, list[tuple[int, int]]]:
    if fmt == "completion":
        prompt = example["prompt"]
        text = prompt + example["completion"] + template.eos_token
        return text, [(len(prompt), len(text))]
    messages = example["messages"]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text, spans = render_spans(
        template.chat_template, plain, template.bos_token, template.eos_token
    )
    weights = [m.get("weight", 1) for m in messages if m["role"] == "assistant"]
    return text, [s for s, w in zip(spans, weights, strict=True) if w]


def encode_example(
    fmt: str, example: dict[str, Any], tokens: Tokens, template: Template, train_on_inputs: bool
) -> Example:
    """The example's tokens and loss mask (the module's rules); LineError(template_error)."""
    try:
        text, spans = _text_and_spans(fmt, example, template)
    except ChatTemplateError as exc:
        raise LineError("template_error", str(exc)) from None
    ids, starts = tokens.encode_offsets(text)
    if train_on_inputs:
        return Example(ids, np.ones(ids.size, dtype=np.uint8))
    chars = np.zeros(len(text) + 1, dtype=np.uint8)  # +1: a token may start at the end
    for start, end in spans:
        chars[start:end] = 1
    return Example(ids, chars[np.minimum(starts, len(text))])


@dataclass
class SftReport:
    """What a chat/completion preparation made: the dataset record's ``report``."""

    format: str
    examples: int = 0  # kept (truncated ones included)
    tokens: int = 0
    target_tokens: int = 0
    loss_share: float = 0.0  # target_tokens / tokens
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> examples
    truncated: int = 0
    max_len: int | None = None
    overlong: str = "drop"
    train_on_inputs: bool = False
    chat_template: str = "default"  # "tokenizer" when the tokenizer's own rendered them
    longest: int = 0  # tokens of the longest kept example
    # Packed (train.data.packing) into rows of packing_seq_len predictions, as a job with
    # that seq_len packs them: max_len - 1, else longest - 1 (the shortest that fits all).
    packing_seq_len: int = 0
    packing_efficiency: float = 0.0  # the share of the rows' slots that are examples' tokens
    # Where each kept example starts in the tokens (not in the record: the .docs files)
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["starts"]
        return out


def build_examples(
    lines: Iterable[tuple[int, dict[str, Any] | LineError]],
    fmt: str,
    tokens: Tokens,
    template: Template,
    *,
    max_len: int | None,
    overlong: str,
    train_on_inputs: bool,
) -> tuple[np.ndarray, np.ndarray, SftReport, Problems]:
    """All examples' tokens and masks back to back, the report, and the bad lines (when
    there are any, the caller refuses the data; collection stops at ``MAX_PROBLEMS``)."""
    report = SftReport(
        format=fmt, max_len=max_len, overlong=overlong, train_on_inputs=train_on_inputs,
        chat_template="tokenizer" if template.chat_template else "default",
    )  # fmt: skip
    problems = Problems()
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    dropped: Counter[str] = Counter()
    for n, item in lines:
        if isinstance(item, LineError):
            problems.add(n, item)
        else:
            try:
                ex = encode_example(fmt, item, tokens, template, train_on_inputs)
            except LineError as exc:
                problems.add(n, exc)
                ex = None
            if ex is not None and max_len is not None and ex.ids.size > max_len:
                if overlong == "drop":
                    dropped["too_long"] += 1
                    ex = None
                else:
                    report.truncated += 1
                    ex = Example(ex.ids[:max_len], ex.mask[:max_len])
            if ex is not None and not problems:
                ids.append(ex.ids)
                masks.append(ex.mask)
        if problems.full():
            break
    report.examples = len(ids)
    report.dropped = dict(dropped)
    if not ids:
        empty = np.zeros(0, dtype=np.uint16)
        return empty, np.zeros(0, dtype=np.uint8), report, problems
    all_ids, all_mask = np.concatenate(ids), np.concatenate(masks)
    report.starts = np.cumsum([0] + [a.size for a in ids[:-1]]).astype(np.int64)
    report.tokens = int(all_ids.size)
    report.target_tokens = int(all_mask.sum())
    report.loss_share = round(report.target_tokens / report.tokens, 6)
    lengths = np.array([a.size for a in ids], dtype=np.int64)
    report.longest = int(lengths.max())
    report.packing_seq_len, report.packing_efficiency = packing_efficiency(lengths, max_len)
    return all_ids, all_mask, report, problems


def packing_efficiency(lengths: np.ndarray, max_len: int | None) -> tuple[int, float]:
    """The seq_len the report packs at (see ``SftReport``) and the share of the packed rows'
    slots that are examples' tokens there (``TokenDataset``'s packing: an example of ``L``
    tokens makes ``L - 1`` predictions; examples of one token are left out)."""
    seq_len = max(1, (max_len if max_len is not None else int(lengths.max())) - 1)
    preds = np.minimum(lengths[lengths >= 2], seq_len + 1) - 1
    if preds.size == 0:
        return seq_len, 0.0
    _, _, n_rows = pack_rows(preds, seq_len)
    return seq_len, round(float(preds.sum()) / (n_rows * seq_len), 6)
