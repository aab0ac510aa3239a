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
import json
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.files import read_plain
from trainer.tokenizer import BYTE, TOKENIZER_FILE, dataset_tokenizer, special_tokens

__all__ = [
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "Completion",
    "Engine",
    "GenerationStopped",
    "HFTokenizer",
    "KVCache",
    "Request",
    "Sampling",
    "Tokenizer",
    "complete",
    "complete_many",
    "context_length",
    "generate_ids",
    "load_tokenizer",
    "sample",
    "token_text",
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
        # Left padding of each row (batched decoding): columns below ``pad[row]`` are not
        # that row's; its token at column c is at position c - pad[row]. None: no padding.
        self.pad: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    def set_pad(self, pad: torch.Tensor) -> None:
        """Rows' left padding; leading columns no row uses are dropped."""
        low = int(pad.min()) if pad.numel() else 0
        if low:
            self.k, self.v = self.k[:, :, :, low:], self.v[:, :, :, low:]
            self.pos, self.max_len, pad = self.pos - low, self.max_len - low, pad - low
        self.pad = pad if bool(pad.any()) else None

    def select(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (the others' requests ended; an index may repeat: rows copied)."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        pad = self.pad[rows] if self.pad is not None else None
        self.set_pad(pad if pad is not None else torch.zeros_like(rows))

    @staticmethod
    def join(caches: Sequence[KVCache], room: int) -> KVCache:
        """One cache of the rows of ``caches``, right-aligned at the newest column (each
        row's tokens keep their positions: its padding grows by the shift), with ``room``
        free columns after it."""
        first = caches[0]
        width = max(c.pos for c in caches)
        layers, _, heads, _, dim = first.k.shape
        out = KVCache(
            layers,
            sum(c.batch for c in caches),
            heads,
            dim,
            width + room,
            dtype=first.k.dtype,
            device=first.k.device,
        )
        pads, row = [], 0
        for c in caches:
            shift, b = width - c.pos, c.batch
            out.k[:, row : row + b, :, shift:width] = c.k[:, :, :, : c.pos]
            out.v[:, row : row + b, :, shift:width] = c.v[:, :, :, : c.pos]
            own = c.pad if c.pad is not None else torch.zeros(b, dtype=torch.long)
            pads.append(own.to(first.k.device) + shift)
            row += b
        out.pos = width
        out.set_pad(torch.cat(pads))
        return out

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
    logprobs: int | None = None  # None: no records; k: each token's and its k most likely
    echo: bool = False  # the prompt's own records (Completion.prompt_logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    eos: tuple[int, ...] = ()  # ids that end a choice ("stop"; not part of its text)


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
    eos_ids: tuple[int, ...]  # ids that end a sequence (none for bytes)
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None  # the dataset's tokenizer_config.json "chat_template"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def stream(self) -> StreamDecoder: ...
    def piece(self, token: int) -> bytes: ...
    def token_str(self, token: int) -> str: ...


class _ByteStream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return str(self._dec.decode(bytes([token]) if 0 <= token < 256 else b"\xff"))

    def flush(self) -> str:
        return str(self._dec.decode(b"", final=True))


class ByteTokenizer:
    """Byte-level: every UTF-8 byte is a token (trainer.prepare's default); no special
    tokens, so no end-of-sequence id and no chat template of its own."""

    vocab_size = 256
    eos_ids: tuple[int, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t if 0 <= t < 256 else 0xFF for t in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return _ByteStream()

    def piece(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def token_str(self, token: int) -> str:
        return token_text(self.piece(token))


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


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece's byte fallback


def _json_file(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(read_plain(path, limit=16 << 20))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package, with the special
    tokens and chat template of the ``tokenizer_config.json`` / ``generation_config.json``
    beside it, when the dataset folder holds them."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self.path = path
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        spec = _json_file(path)
        self._added = {
            int(t["id"]): str(t["content"])
            for t in spec.get("added_tokens") or ()
            if isinstance(t, dict) and "id" in t and "content" in t
        }
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        self._pieces: dict[int, bytes] = {}
        config = _json_file(path.parent / "tokenizer_config.json")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name", "template"}]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template = template if isinstance(template, str) else None
        self.eos_ids = _eos_ids(self, config, _json_file(path.parent / "generation_config.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def stream(self) -> StreamDecoder:
        return _HFStream(self)

    def token_id(self, text: str) -> int | None:
        found = self._tok.token_to_id(text)
        return None if found is None else int(found)

    def token_str(self, token: int) -> str:
        """The vocabulary's own spelling (``Ġthe``, ``▁the``), as ``convert_ids_to_tokens``."""
        return str(self._tok.id_to_token(token) or "")

    def piece(self, token: int) -> bytes:
        """The bytes ``token`` stands for on its own."""
        got = self._pieces.get(token)
        if got is None:
            got = self._piece(token)
            self._pieces[token] = got
        return got

    def _piece(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode()
        spelled = self._tok.id_to_token(token)
        if spelled is None:
            return b""
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in spelled):
                return bytes(table[ch] for ch in spelled)
        found = _BYTE_PIECE.match(spelled)
        if found:
            return bytes([int(found.group(1), 16)])
        if "\u2581" in spelled:  # sentencepiece's word boundary
            return spelled.replace("\u2581", " ").encode()
        return self.decode([token]).encode()


def _eos_ids(
    tok: HFTokenizer, config: dict[str, Any], generation: dict[str, Any]
) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's ``eos_token_id`` (an id or a list),
    tokenizer_config.json's ``eos_token``, and the eos an export declares for this tokenizer
    (``trainer.tokenizer.special_tokens``: the side files, the template, then a special token
    with a well-known end-of-text name), so generation stops wherever the export says."""
    found: list[int] = []
    raw = generation.get("eos_token_id")
    for value in raw if isinstance(raw, list) else [raw]:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            found.append(value)
    named = tok.eos_token
    if named is not None and tok.token_id(named) is not None:
        found.append(int(tok.token_id(named)))  # type: ignore[arg-type]
    declared = special_tokens(tok.path).get("eos")
    if declared is not None:
        found.append(declared.id)
    return tuple(dict.fromkeys(found))


_UNICODE_TO_BYTE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is written as."""
    if not _UNICODE_TO_BYTE:
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        chars, extra = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + extra)
                extra += 1
        _UNICODE_TO_BYTE.update({chr(c): b for b, c in zip(printable, chars, strict=True)})
    return _UNICODE_TO_BYTE


def load_tokenizer(dataset_dir: Path) -> Tokenizer:
    """The tokenizer a dataset was prepared with (``trainer.tokenizer.dataset_tokenizer``:
    its ``tokenizer.json``, else bytes); TokenizerError (a ValueError) when it is gone."""
    found = dataset_tokenizer(dataset_dir)
    return ByteTokenizer() if found == BYTE else HFTokenizer(Path(found))


def token_text(raw: bytes) -> str:
    """A token's text as OpenAI writes it: its own text when its bytes are UTF-8 alone,
    else ``bytes:\\xNN...``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _record(
    tok: Tokenizer, token: int, logprob: float, top: list[tuple[int, float]], offset: int | None
) -> dict[str, Any]:
    """A token's log-probability record (worker.genmessage's docstring)."""
    raw = tok.piece(token)
    rec: dict[str, Any] = {"id": token, "token": token_text(raw), "bytes": list(raw),
                           "logprob": logprob}  # fmt: skip
    if offset is not None:
        rec["offset"] = offset
        rec["top"] = [_record(tok, t, lp, [], None) for t, lp in top]
    return rec


def _logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """log_softmax of raw ``logits`` ``[R, V]`` in float32: of ``chosen`` ``[R]``, and the
    ``k`` most likely per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, chosen[:, None]).squeeze(1).tolist()
    if k <= 0:
        return own, [[] for _ in own]
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    tops = [list(zip(i, v, strict=True)) for i, v in pairs]
    return own, tops


# ----------------------------------------------------------------------------- completion


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Completion:
    choices: list[Choice]
    prompt_tokens: int
    seed: int | None
    prompt_text: str = ""
    prompt_logprobs: list[dict[str, Any] | None] | None = None

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
        self.chars = 0  # characters decoded so far (the next token's offset)

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

    def finish(self) -> tuple[str, bool]:
        """The text still held at the end (a partial character, a stop string's start)."""
        text, stopped = self.feed(self.decoder.flush())
        return (text, True) if stopped else (text + self.held, False)


Delta = tuple[int, str, list[int], list[dict[str, Any]] | None]


@dataclass(eq=False)
class Request:
    """One prompt's generation as the ``Engine`` decodes it beside others. ``on_delta``
    gets, per step, ``(index, text, token_ids, records)`` of its choices that produced any
    (records None without ``logprobs``); ``check(tokens_so_far)`` runs before each step and
    may raise GenerationStopped (a deadline, a cancel), which ends this request alone."""

    prompt: Sequence[int]
    params: Sampling
    on_delta: Callable[[list[Delta]], None] | None = None
    check: Callable[[int], None] | None = None
    result: Completion | None = None
    error: BaseException | None = None
    batch: int = 0  # requests decoding together: when it joined, then the most while it ran


class _Live:
    """A request being decoded: its rows of the batch and its own sampling state."""

    def __init__(self, req: Request, tok: Tokenizer, vocab: int, limit: int, device: Any):
        p = req.params
        self.req, self.n = req, p.n
        self.steps = min(p.max_tokens, limit - len(req.prompt) + 1)
        self.done = 0
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        self.gen: torch.Generator | None = None
        if p.temperature >= GREEDY_BELOW:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed)
        self.choices = [Choice(i, logprobs=[] if p.logprobs is not None else None)
                        for i in range(p.n)]  # fmt: skip
        self.texts = [_Text(tok.stream(), p.stop) for _ in self.choices]
        self.eos = set(p.eos)
        self.counts = (
            torch.zeros(p.n, vocab, device=device)
            if p.presence_penalty or p.frequency_penalty
            else None
        )
        bias = [(t, b) for t, b in p.logit_bias if 0 <= t < vocab]
        self.bias = (
            (torch.tensor([t for t, _ in bias], device=device),
             torch.tensor([b for _, b in bias], device=device))
            if bias else None
        )  # fmt: skip
        prompt_text = tok.decode(req.prompt)
        self.shift = len(prompt_text) if p.echo else 0  # with echo, offsets in prompt + text
        req.result = Completion(self.choices, len(req.prompt),
                                seed if self.gen is not None else None,
                                prompt_text=prompt_text)  # fmt: skip

    def adjusted(self, raw: torch.Tensor) -> torch.Tensor:
        """Logits to sample from: raw, less the penalties, plus the biases (float32)."""
        p = self.req.params
        logits = raw.float()
        if self.counts is not None:
            logits = logits - self.counts * p.frequency_penalty
            logits = logits - (self.counts > 0).float() * p.presence_penalty
        if self.bias is not None:
            logits = logits.index_add(1, self.bias[0], self.bias[1].expand(logits.shape[0], -1))
        return logits


class _HFRows:
    """The ``hf`` family's batch state: transformers' ``DynamicCache`` and the rows'
    attention mask (``[rows, columns]``, 1 where a row has a token) and newest positions.
    Rows are left-padded and right-aligned, as in ``KVCache``."""

    def __init__(self, model: Any, ids: torch.Tensor, pad: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.inner = model.inner
        args = _forward_args(self.inner)
        self.name = "cache" if "cache" in args else "past_key_values"
        self.trim = "logits_to_keep" in args
        cols = torch.arange(ids.shape[1], device=ids.device)
        self.mask = (cols[None, :] >= pad[:, None]).long()
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache: Any = DynamicCache()
        self.padded = bool(pad.any())

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    def forward(self, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Logits of ``ids`` at ``self.positions`` (only the last position's if ``last``)."""
        extra: dict[str, Any] = {}
        if self.padded:
            extra = {"attention_mask": self.mask, "position_ids": self.positions}
        if last and self.trim:
            extra["logits_to_keep"] = 1
        out = self.inner(input_ids=ids, use_cache=True, **{self.name: self.cache}, **extra)
        self.cache = getattr(out, self.name)
        self.positions = self.positions[:, -1:]
        logits: torch.Tensor = out.logits
        return logits

    def grow(self) -> None:
        """The next token of every row: one more column, one more position."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.batch, 1)], dim=1)
        self.positions = self.positions + 1

    def joinable(self) -> bool:
        """Whether rows can be added: every layer a plain ``DynamicLayer`` (a sliding
        window or a recurrent state would need its own alignment)."""
        layers: list[Any] = list(getattr(self.cache, "layers", None) or ())
        return bool(layers) and all(type(x).__name__ == "DynamicLayer" for x in layers)

    def select(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (an index may repeat: rows copied); leading columns no row uses
        are dropped."""
        same = torch.arange(self.batch, device=rows.device)
        if rows.numel() != self.batch or not bool((rows == same).all()):
            self.cache.batch_select_indices(rows)
            self.mask, self.positions = self.mask[rows], self.positions[rows]
        used = self.mask.any(dim=0)
        first = int(used.long().argmax()) if bool(used.any()) else 0
        if first and self.joinable():
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]

    def join(self, other: _HFRows) -> None:
        """Add ``other``'s rows, both right-aligned at the newest column."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def left(t: torch.Tensor, dim: int) -> torch.Tensor:
            extra = width - t.shape[dim]
            if not extra:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left(mine.keys, 2), left(theirs.keys, 2)])
            mine.values = torch.cat([left(mine.values, 2), left(theirs.values, 2)])
        self.mask = torch.cat([left(self.mask, 1), left(other.mask, 1)])
        self.positions = torch.cat([self.positions[:, -1:], other.positions[:, -1:]])
        self.padded = self.padded or other.padded or not bool(self.mask.all())


class Engine:
    """Decodes several requests to one model together, one forward per step for all.

    Rows (each request's ``n`` choices) share one KV cache, left-padded: requests join
    (``add``) with their prompts' prefill, right-aligned at the batch's newest column, so
    each row keeps its own positions; a request that ends leaves the batch and its rows
    are dropped from the cache. Each request samples its own rows with its own parameters,
    generator, penalties and stop strings, so its result is what it would be alone (greedy:
    the same tokens; log-probabilities within float error). The ``hf`` family decodes
    through transformers' cache with an attention mask and position ids (``_HFRows``);
    requests join it the same way where its layers are plain ``DynamicLayer`` (else only
    while it is empty: static batching).
    """

    def __init__(self, model: Any, tokenizer: Tokenizer) -> None:
        self.model, self.tok = model, tokenizer
        self.hf = hasattr(model, "inner")
        self.device = next(model.parameters()).device
        self.limit = context_length(model)
        self.live: list[_Live] = []
        self.cache: Any = None  # KVCache, or _HFRows for the hf family
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next token

    @property
    def can_join(self) -> bool:
        return not self.live or not self.hf or self.cache.joinable()

    @property
    def rows(self) -> int:
        return sum(live.n for live in self.live)

    def check(self, req: Request) -> None:
        """ValueError when ``req`` cannot be decoded (the worker checks first, as a 422)."""
        if not req.prompt:
            raise ValueError("the prompt is empty")
        if len(req.prompt) > self.limit:
            raise ValueError(f"the prompt is {len(req.prompt)} tokens; the context is {self.limit}")

    @torch.no_grad()
    def add(self, reqs: Sequence[Request]) -> list[Request]:
        """Prefill ``reqs`` and join them to the batch; those already finished (``echo``
        with ``max_tokens`` 0) are returned."""
        if not reqs:
            return []
        if not self.can_join:
            raise RuntimeError("this model's batch takes requests only when it is empty")
        for req in reqs:
            self.check(req)
        # Requests with the same prompt share one prefill row, as a request's n choices do
        # (an evaluation harness sends a multiple-choice item's repeats, or the same context
        # and continuation, together): its keys and values are copied to each of their rows.
        unique: dict[tuple[int, ...], int] = {}
        row_of = [unique.setdefault(tuple(req.prompt), len(unique)) for req in reqs]
        prompts = [list(p) for p in unique]
        logits, pending = self._prefill(prompts, any(r.params.echo for r in reqs))
        width, vocab = logits.shape[1], logits.shape[-1]
        new: list[_Live] = []
        keep: list[int] = []  # the prefill row of each batch row: a request's n choices
        ended: list[Request] = []
        echoed: dict[tuple[int, int], list[dict[str, Any] | None]] = {}
        for row, req in zip(row_of, reqs, strict=True):
            live = _Live(req, self.tok, vocab, self.limit, self.device)
            if req.params.echo:
                key = (row, req.params.logprobs or 0)
                if key not in echoed:
                    echoed[key] = self._echo(live, logits[row, width - len(req.prompt) : width - 1])
                assert req.result is not None
                req.result.prompt_logprobs = echoed[key]
            if live.steps <= 0:
                self._close(live)
                ended.append(req)
            else:
                new.append(live)
                keep.extend([row] * live.n)
        if not keep:
            return ended
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        last = logits[rows, -1]
        self.logits = last if self.logits is None else torch.cat([self.logits, last])
        had = bool(self.live)
        self.live.extend(new)
        pending.select(rows)  # the prompt's keys and values, copied to each of its n rows
        if self.hf:
            if had:
                self.cache.join(pending)
            else:
                self.cache = pending
        else:
            parts = [self.cache, pending] if had else [pending]
            room = max(live.steps - live.done for live in self.live)
            self.cache = KVCache.join(parts, room)
        for live in self.live:
            live.req.batch = max(live.req.batch, len(self.live))
        return ended

    def _prefill(self, prompts: Sequence[list[int]], echo: bool) -> tuple[torch.Tensor, Any]:
        """Logits ``[prompts, T, vocab]`` of the left-padded ``prompts`` (only the last
        position's for the hf family unless ``echo``), and their cache."""
        width = max(len(p) for p in prompts)
        ids, pads = [], []
        for p in prompts:
            pads.append(width - len(p))
            ids.append([0] * pads[-1] + p)
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        pad = torch.tensor(pads, dtype=torch.long, device=self.device)
        if self.hf:
            rows = _HFRows(self.model, x, pad)
            # Only the last position's logits unless a prompt's own are asked for: a large
            # vocabulary times every prompt position is gigabytes.
            return rows.forward(x, last=not echo), rows
        cfg = self.model.cfg
        param = next(self.model.parameters())
        pending = KVCache(
            cfg.n_layer, x.shape[0], getattr(cfg, "kv_heads", cfg.n_head),
            cfg.d_model // cfg.n_head, width, dtype=param.dtype, device=param.device,
        )  # fmt: skip
        pending.set_pad(pad)
        return self.model.forward_cached(x, pending), pending

    def _echo(self, live: _Live, logits: torch.Tensor) -> list[dict[str, Any] | None]:
        """The prompt's own records from its prefill logits (``[len - 1, vocab]``: position
        i predicts token i + 1); the first is None."""
        prompt = list(live.req.prompt)
        k = live.req.params.logprobs or 0
        own, tops = _logprobs(logits, torch.tensor(prompt[1:], device=logits.device), k)
        dec, offsets, chars = self.tok.stream(), [], 0
        for token in prompt:
            offsets.append(chars)
            chars += len(dec.push(token))
        records: list[dict[str, Any] | None] = [None]
        for i, token in enumerate(prompt[1:], start=1):
            records.append(_record(self.tok, token, own[i - 1], tops[i - 1], offsets[i]))
        return records

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One token for every live request; those that ended are returned (their
        ``result`` complete, or ``error`` set)."""
        assert self.logits is not None
        tokens: list[torch.Tensor] = []
        ended: list[_Live] = []
        keep: list[int] = []
        row = 0
        for live in self.live:
            raw = self.logits[row : row + live.n]
            try:
                if live.req.check is not None:
                    live.req.check(live.done)
                token = self._advance(live, raw)
            except GenerationStopped as exc:
                live.req.error = exc
                token = None
            if (
                token is None
                or live.done >= live.steps
                or all(c.finish_reason is not None for c in live.choices)
            ):
                if live.req.error is None:
                    self._close(live)
                ended.append(live)
            else:
                tokens.append(token)
                keep.extend(range(row, row + live.n))
            row += live.n
        self.live = [live for live in self.live if live not in ended]
        if not self.live:
            self.logits, self.cache = None, None
            return [live.req for live in ended]
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        last = torch.cat(tokens)[:, None]
        if ended:
            self.cache.select(rows)
        if self.hf:
            self.cache.grow()
            self.logits = self.cache.forward(last)[:, -1]
        else:
            self.logits = self.model.forward_cached(last, self.cache)[:, -1]
        return [live.req for live in ended]

    def _advance(self, live: _Live, raw: torch.Tensor) -> torch.Tensor:
        """Sample ``live``'s next tokens from its rows' logits and take them in."""
        p = live.req.params
        token = sample(live.adjusted(raw), p, live.gen)
        values = token.tolist()
        own: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        if p.logprobs is not None:
            own, tops = _logprobs(raw, token, p.logprobs)
        if live.counts is not None:
            live.counts[torch.arange(live.n, device=token.device), token] += 1
        deltas: list[Delta] = []
        for i, (c, t, tok_id) in enumerate(zip(live.choices, live.texts, values, strict=True)):
            if c.finish_reason is not None:
                continue
            c.token_ids.append(tok_id)
            recs = None
            if c.logprobs is not None:
                recs = [_record(self.tok, tok_id, own[i], tops[i], live.shift + t.chars)]
                c.logprobs.extend(recs)
            if tok_id in live.eos:
                # As vLLM: the EOS token is the choice's last id, with its log-probability
                # (lm-eval's echo reads "prompt, then one generated token"), not its text.
                text, _ = t.finish()
                c.finish_reason = "stop"
                c.text += text
                deltas.append((c.index, text, [tok_id], recs))
                continue
            piece = t.decoder.push(tok_id)
            t.chars += len(piece)
            text, stopped = t.feed(piece)
            if stopped:
                c.finish_reason = "stop"
            c.text += text
            deltas.append((c.index, text, [tok_id], recs))
        live.done += 1
        if live.req.on_delta is not None and deltas:
            live.req.on_delta(deltas)
        return token

    def _close(self, live: _Live) -> None:
        """A request's end: choices still open end at ``length``, their held text out."""
        tail: list[Delta] = []
        for c, t in zip(live.choices, live.texts, strict=True):
            if c.finish_reason is None:
                text, stopped = t.finish()
                c.finish_reason = "stop" if stopped else "length"
                if text:
                    c.text += text
                    tail.append((c.index, text, [], [] if c.logprobs is not None else None))
        if live.req.on_delta is not None and tail:
            live.req.on_delta(tail)

    def run(self) -> list[Request]:
        """Decode until every live request ended."""
        ended: list[Request] = []
        while self.live:
            ended.extend(self.step())
        return ended


def complete_many(model: Any, tokenizer: Tokenizer, reqs: Sequence[Request]) -> list[Request]:
    """Decode ``reqs`` together (``Engine``); each ends with ``result`` or ``error``."""
    engine = Engine(model, tokenizer)
    engine.add(reqs)
    engine.run()
    return list(reqs)


def complete(
    model: Any,
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    params: Sampling,
    *,
    on_delta: Callable[[list[Delta]], None] | None = None,
    check: Callable[[int], None] | None = None,
) -> Completion:
    """Generate ``params.n`` completions of ``prompt``: a ``Request`` decoded alone."""
    req = Request(prompt, params, on_delta, check)
    engine = Engine(model, tokenizer)
    engine.add([req])
    engine.run()
    if req.error is not None:
        raise req.error
    assert req.result is not None
    return req.result
