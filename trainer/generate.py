"""Token generation from a trained model: a KV cache, sampling, stop strings and a streaming
detokenizer that never splits a UTF-8 character.

    model, step = trainer.export.load_model(run_dir)          # any strategy, LoRA merged
    tok = load_tokenizer(dataset_dir)                          # bytes, or its tokenizer.json
    result = complete(model, tok, tok.encode("Once"), Sampling(max_tokens=64, temperature=0))

Incremental decoding: the gpt and llama families run ``forward_cached`` (trainer/model.py,
trainer/llama.py) over a preallocated ``KVCache``; the hf family uses transformers' own
cache (``DynamicCache``). ``use_cache=False`` recomputes the whole sequence each step with
the training ``forward`` (the reference the cache is tested against).

Sampling: ``temperature`` 0 (or below ``GREEDY_BELOW``) is greedy (argmax); else
(logits - max) / temperature, then ``top_k`` and ``top_p`` (nucleus, always keeping the top
token) filters, then one draw per sequence from a ``torch.Generator`` seeded with ``seed``,
so a seed repeats exactly (on the same device and torch). ``n`` sequences are decoded as
one batch. A sequence ends at ``max_tokens``, at a stop string (its
text cut before it, as OpenAI does), or when the context (``seq_len``) is full; the finish
reason is ``stop`` or ``length``.

Text: a dataset prepared byte-level (vocab 256) decodes tokens as UTF-8 bytes through an
incremental decoder; one prepared with a Hugging Face tokenizer has ``tokenizer.json`` in
its folder and decodes through ``tokenizers``, emitting only text that is complete (a
trailing partial character, U+FFFD, is held back until the next token completes it).
"""

from __future__ import annotations

import codecs
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.tokenizer import BYTE, TOKENIZER_FILE, dataset_tokenizer

__all__ = [
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "Completion",
    "GenerationStopped",
    "HFTokenizer",
    "KVCache",
    "Sampling",
    "Tokenizer",
    "complete",
    "context_length",
    "generate_ids",
    "load_tokenizer",
    "sample",
]


class GenerationStopped(Exception):
    """Raised by a ``check`` callback (a deadline, a shutdown) to end generation early."""


# ---------------------------------------------------------------------------------- cache


class KVCache:
    """Keys and values of every layer, ``[layers, batch, kv_heads, max_len, head_dim]``,
    filled from position 0; ``pos`` is how many positions are filled."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.pos = 0
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # llama's tables, lazily

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``k``, ``v`` (``[B, H, T, D]``) at ``pos``; the layer's keys
        and values of positions ``0 .. pos+T``."""
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n


def context_length(model: Any) -> int:
    """The longest sequence (prompt + generated) the model takes: its ``seq_len``."""
    return int(model.cfg.seq_len)


class _Stepper:
    """One family's decoding step: ``prefill(ids)`` then ``step(last)``, logits of the last
    position ``[B, vocab]``."""

    def __init__(self, model: Any, batch: int, max_len: int, use_cache: bool) -> None:
        self.model = model
        self.use_cache = use_cache
        self.kind = "hf" if hasattr(model, "inner") else "native"
        self.seq: torch.Tensor | None = None
        self.cache: Any = None
        if not use_cache:
            return
        if self.kind == "hf":
            from transformers import DynamicCache

            self.cache = DynamicCache()
        else:
            cfg = model.cfg
            param = next(model.parameters())
            kv_heads = getattr(cfg, "kv_heads", cfg.n_head)
            self.cache = KVCache(
                cfg.n_layer,
                batch,
                kv_heads,
                cfg.d_model // cfg.n_head,
                max_len,
                dtype=param.dtype,
                device=param.device,
            )

    def _full(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "hf":
            return self.model.inner(input_ids=ids, use_cache=False).logits
        return self.model(ids)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.use_cache:
            self.seq = ids
            return self._full(ids)[:, -1]
        if self.kind == "hf":
            # transformers 5 names the argument ``cache`` (``past_key_values`` before).
            name = "cache" if "cache" in _forward_args(self.model.inner) else "past_key_values"
            out = self.model.inner(input_ids=ids, use_cache=True, **{name: self.cache})
            self.cache = getattr(out, name)
            return out.logits[:, -1]
        return self.model.forward_cached(ids, self.cache)[:, -1]

    def step(self, last: torch.Tensor) -> torch.Tensor:
        return self.prefill(last[:, None]) if self.use_cache else self._grow(last)

    def _grow(self, last: torch.Tensor) -> torch.Tensor:
        assert self.seq is not None
        self.seq = torch.cat([self.seq, last[:, None]], dim=1)
        return self._full(self.seq)[:, -1]


def _forward_args(module: Any) -> set[str]:
    import inspect

    return set(inspect.signature(module.forward).parameters)


# ------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: drawn (and reported in Completion.seed)
    stop: tuple[str, ...] = ()
    n: int = 1


# Below this a temperature is greedy: dividing by it would turn every logit gap into an
# infinity (1e-45 is a valid float and a valid request), and the draw would be the argmax.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, params: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, vocab]``.

    Computed so that no valid parameter yields inf or nan: the max logit is subtracted
    before dividing by the temperature (every value is then <= 0, the best exactly 0), and
    top_p always keeps the most likely token, however small top_p is.
    """
    logits = logits.float()
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the ones above it already reach top_p. The first always stays:
        # a top_p below float32's range compares as 0, which would drop every token.
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[:, 0] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate_ids(
    model: Any,
    prompt: Sequence[int],
    params: Sampling,
    *,
    use_cache: bool = True,
    seed: int | None = None,
) -> Iterator[torch.Tensor]:
    """The new tokens ``[n]`` of each step, until ``max_tokens`` or a full context (the
    caller stops earlier by no longer iterating)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    limit = context_length(model)
    if len(prompt) > limit:
        raise ValueError(f"the prompt is {len(prompt)} tokens; the context is {limit}")
    steps = min(params.max_tokens, limit - len(prompt) + 1)
    device = next(model.parameters()).device
    gen = None
    if params.temperature >= GREEDY_BELOW:
        gen = torch.Generator(device=device)
        drawn = params.seed if seed is None else seed
        gen.manual_seed(drawn if drawn is not None else secrets.randbits(63))
    ids = torch.tensor([list(prompt)] * params.n, dtype=torch.long, device=device)
    stepper = _Stepper(model, params.n, min(limit, len(prompt) + steps), use_cache)
    logits = stepper.prefill(ids)
    for i in range(steps):
        token = sample(logits, params, gen)
        yield token
        if i + 1 < steps:
            logits = stepper.step(token)


# ---------------------------------------------------------------------------- tokenizers


class StreamDecoder(Protocol):
    def push(self, token: int) -> str: ...
    def flush(self) -> str: ...


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def stream(self) -> StreamDecoder: ...


class _ByteStream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return str(self._dec.decode(bytes([token]) if 0 <= token < 256 else b"\xff"))

    def flush(self) -> str:
        return str(self._dec.decode(b"", final=True))


class ByteTokenizer:
    """Byte-level: every UTF-8 byte is a token (trainer.prepare's default)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t if 0 <= t < 256 else 0xFF for t in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return _ByteStream()


class _HFStream:
    """Text Generation Inference's incremental detokenization: decode a short window of ids
    and emit what it adds, unless it ends in U+FFFD (a character still incomplete)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # window start: decoding from here gives context to the next ids
        self.read = 0  # ids up to here are emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def stream(self) -> StreamDecoder:
        return _HFStream(self)


def load_tokenizer(dataset_dir: Path) -> Tokenizer:
    """The tokenizer a dataset was prepared with (``trainer.tokenizer.dataset_tokenizer``:
    its ``tokenizer.json``, else bytes); TokenizerError (a ValueError) when it is gone."""
    found = dataset_tokenizer(dataset_dir)
    return ByteTokenizer() if found == BYTE else HFTokenizer(Path(found))


# ----------------------------------------------------------------------------- completion


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    choices: list[Choice]
    prompt_tokens: int
    seed: int | None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class _Text:
    """One sequence's text: decoded as tokens come, cut at a stop string, and emitted only
    when no stop string can still begin in it."""

    def __init__(self, decoder: StreamDecoder, stop: tuple[str, ...]) -> None:
        self.decoder = decoder
        self.stop = stop
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string ended the sequence)."""
        buf = self.held + piece
        cut = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = 0
        for s in self.stop:  # the longest tail of buf that starts a stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False


def complete(
    model: Any,
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    params: Sampling,
    *,
    use_cache: bool = True,
    on_delta: Callable[[list[tuple[int, str, list[int]]]], None] | None = None,
    check: Callable[[int], None] | None = None,
) -> Completion:
    """Generate ``params.n`` completions of ``prompt``. ``on_delta`` gets, per step, the new
    ``(index, text, token_ids)`` of the sequences that produced any; ``check(tokens_so_far)``
    runs before each step and may raise GenerationStopped (a deadline)."""
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    choices = [Choice(i) for i in range(params.n)]
    texts = [_Text(tokenizer.stream(), params.stop) for _ in choices]
    produced = 0
    for tokens in generate_ids(model, prompt, params, use_cache=use_cache, seed=seed):
        if check is not None:
            check(produced)
        deltas = []
        for c, t, token in zip(choices, texts, tokens.tolist(), strict=True):
            if c.finish_reason is not None:
                continue
            c.token_ids.append(token)
            text, stopped = t.feed(t.decoder.push(token))
            if stopped:
                c.finish_reason = "stop"
            c.text += text
            if text or stopped or on_delta is not None:
                deltas.append((c.index, text, [token]))
        produced += 1
        if on_delta is not None and deltas:
            on_delta(deltas)
        if all(c.finish_reason is not None for c in choices):
            break
    tail: list[tuple[int, str, list[int]]] = []
    for c, t in zip(choices, texts, strict=True):
        if c.finish_reason is None:
            c.finish_reason = "length"
            text, stopped = t.feed(t.decoder.flush())
            text += "" if stopped else t.held
            if stopped:
                c.finish_reason = "stop"
            if text:
                c.text += text
                tail.append((c.index, text, []))
    if on_delta is not None and tail:
        on_delta(tail)
    return Completion(choices, len(prompt), seed if params.temperature >= GREEDY_BELOW else None)
