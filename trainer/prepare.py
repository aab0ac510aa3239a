"""Turn UTF-8 text files into llm.c-format train/val token shards.

``python -m trainer.prepare --out DIR [--val-fraction 0.1] [--shard-tokens N]
[--tokenizer PATH/tokenizer.json] FILE...`` writes ``DIR/train_000000.bin ...`` and
``DIR/val_000000.bin ...`` plus ``DIR/meta.json`` (tokenizer, vocab size, token counts).

The default tokenizer is byte-level: every UTF-8 byte is a token (vocab 256), so any text
works and the tokens decode back with ``bytes(tokens).decode("utf-8")``. With ``--tokenizer``
a local Hugging Face ``tokenizer.json`` is used through the optional ``tokenizers`` package
(``pip install 'trainq[hf]'``); its vocabulary must fit uint16. That file is copied into
the dataset as ``DIR/tokenizer.json`` and meta.json names it so (``"tokenizer":
"tokenizer.json"``, else ``"byte"``): a dataset carries what decodes it, and
``trainer.export --format hf`` puts it beside the weights (trainer.tokenizer).

The folder and the folders made for it are 0750, the shards, meta.json and tokenizer.json 0640,
whatever the
umask (trainer.files): the dataset is read by jobs of the whole group.

Files are concatenated in the order given; the last ``val_fraction`` of the tokens is the
validation split.

``--format chat`` or ``--format completion`` (:func:`prepare_sft`) reads JSON Lines of
conversations or prompt/completion pairs instead (``trainer.sft``: the checks, the chat
template, which tokens carry loss). Beside each token shard it writes the loss mask
(``train_000000.mask``, trainer.data) and where its examples start (``train_000000.docs``:
what ``train.data.packing`` packs by; shards and the val split are cut at an example's
start, the one nearest to the val fraction, unless an example is longer than a shard),
beside ``tokenizer.json`` the tokenizer's ``tokenizer_config.json`` (its chat template and
special tokens, so serving renders as training did), and into meta.json a ``sft`` report:
examples, tokens, target tokens and their share, what was dropped or truncated and why.
Options: ``--max-len N`` with ``--overlong drop|truncate``, ``--train-on-inputs``. A bad
line fails the whole preparation with the first few bad lines and their numbers.

Bad input is a :class:`~trainer.data.DataError` from :func:`prepare`; the CLI prints it
as one line on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import (
    META_FILE,
    DataError,
    docs_name,
    mask_name,
    write_docs,
    write_mask,
    write_shard,
)
from trainer.files import NotPlainFile, make_dirs, read_plain, set_mode
from trainer.sft import (
    OVERLONG,
    SFT_FORMATS,
    ByteTokens,
    Template,
    build_examples,
    read_lines,
)
from trainer.shard_stream import ShardStream, val_tokens
from trainer.tokenizer import BYTE, TOKENIZER_FILE

__all__ = ["PrepareSummary", "byte_summary", "main", "prepare", "prepare_demo", "prepare_sft"]

TOKENIZER_CONFIG = "tokenizer_config.json"

BYTE_VOCAB = 256
UINT16_VOCAB = 1 << 16
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's shard size
# Text is handed to a HF tokenizer in chunks of whole lines, so memory stays bounded.
_CHUNK_CHARS = 1 << 20
# Byte-level text is checked and turned into tokens in pieces this size.
_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class PrepareSummary:
    out: str
    tokenizer: str  # "byte", or "tokenizer.json": the copy in the dataset folder
    vocab_size: int
    train_tokens: int
    val_tokens: int
    train_shards: int
    val_shards: int
    sft: dict[str, Any] | None = None  # chat/completion data: trainer.sft.SftReport

    def line(self) -> str:
        return (
            f"prepared {self.out}: {self.train_tokens} train tokens in {self.train_shards} "
            f"shard(s), {self.val_tokens} val tokens in {self.val_shards} shard(s), "
            f"vocab size {self.vocab_size} ({self.tokenizer})"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["sft"] is None:
            del out["sft"]
        return out


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"input file {path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"input file {path} is a directory") from None
    except OSError as exc:
        raise DataError(f"input file {path}: cannot read: {exc.strerror}") from exc
    if not raw:
        raise DataError(f"input file {path} is empty")
    return raw


def _not_utf8(path: Path, raw: bytes, exc: UnicodeDecodeError) -> DataError:
    return DataError(
        f"input file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
    )


def _read_text(path: Path) -> str:
    raw = _read_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, raw, exc) from None


def _read_utf8(path: Path) -> bytes:
    """The file's bytes, checked to be UTF-8 a chunk at a time (no str of it all is kept:
    byte-level tokens are the bytes themselves)."""
    raw = _read_bytes(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for start in range(0, len(raw), _CHUNK_BYTES):
            chunk = raw[start : start + _CHUNK_BYTES]
            # ASCII is UTF-8: checked at memory speed, unless a character is pending
            if not (chunk.isascii() and not decoder.getstate()[0]):
                decoder.decode(chunk, False)
        decoder.decode(b"", True)
    except UnicodeDecodeError:
        try:  # rare: decode it whole, for the offset
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, raw, exc) from None
        raise  # pragma: no cover (the whole text decodes only if every chunk did)
    return raw


class _HFTokenizer:
    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer needs the 'tokenizers' package: pip install 'trainq[hf]'"
            ) from None
        try:
            # Read once, never through a link: the text that tokenizes is the text copied
            # into the dataset.
            self.text: str | None = read_plain(path).decode("utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer file {path} does not exist") from None
        except NotPlainFile as exc:
            raise DataError(f"tokenizer file {path} {exc.strerror}") from None
        except (OSError, UnicodeDecodeError):
            raise DataError(f"tokenizer file {path} cannot be read as UTF-8 text") from None
        try:
            self._tok = Tokenizer.from_str(self.text)
        except Exception:  # the Rust side raises a bare Exception on bad JSON
            # Not the parser's words: they quote the file (an oracle for its content).
            raise DataError(
                f"tokenizer file {path} cannot be loaded as a Hugging Face tokenizer.json"
            ) from None
        self.name = TOKENIZER_FILE
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        if self.vocab_size > UINT16_VOCAB:
            raise DataError(
                f"tokenizer {path} has vocab size {self.vocab_size}; shards hold uint16 "
                f"tokens, so at most {UINT16_VOCAB}"
            )

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``text`` (no special tokens added) and each token's first character."""
        enc = self._tok.encode(text, add_special_tokens=False)
        starts = np.fromiter((a for a, _ in enc.offsets), np.int64, len(enc.ids))
        return np.asarray(enc.ids, dtype=np.uint16), starts

    def encode(self, text: str) -> np.ndarray:
        parts = [
            np.asarray(enc.ids, dtype=np.uint16)
            for enc in self._tok.encode_batch(list(_line_chunks(text)), add_special_tokens=False)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _line_chunks(text: str) -> Iterator[str]:
    """Whole lines grouped into chunks of about _CHUNK_CHARS characters."""
    buf: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        buf.append(line)
        size += len(line)
        if size >= _CHUNK_CHARS:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def _write_split(out: Path, split: str, tokens: np.ndarray, shard_tokens: int) -> int:
    starts = range(0, tokens.size, shard_tokens)
    for n, start in enumerate(starts):
        write_shard(out / f"{split}_{n:06d}.bin", tokens[start : start + shard_tokens])
    return len(starts)


def prepare(
    files: Sequence[str | Path],
    out: str | Path,
    *,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> PrepareSummary:
    """Tokenize ``files`` into ``out``; DataError (one line) on any bad input.

    ``out`` must not already hold shards unless ``overwrite``, which first removes them: a
    stale ``train_000007.bin`` from an earlier, larger run would silently join the split.
    """
    if not files:
        raise DataError("no input files given")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if not 1 <= shard_tokens <= np.iinfo(np.int32).max:
        raise DataError(f"shard tokens must be in 1..{np.iinfo(np.int32).max}, got {shard_tokens}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} exists and is not a directory")
    if tokenizer is None:
        return _prepare_bytes(files, out, val_fraction, shard_tokens, overwrite)
    tok = _HFTokenizer(Path(tokenizer))
    texts = [_read_text(Path(f)) for f in files]  # read all first: fail before writing anything
    parts = [tok.encode(t) for t in texts]
    tokens = np.concatenate(parts)
    if tokens.size == 0:
        raise DataError("the input files produced no tokens")
    n_val = _val_tokens(tokens.size, val_fraction)
    existing = _existing(out, overwrite)
    try:
        make_dirs(out)
        for old in existing:
            old.unlink()
        train, val = tokens[: tokens.size - n_val], tokens[tokens.size - n_val :]
        summary = PrepareSummary(
            out=str(out),
            tokenizer=tok.name,
            vocab_size=tok.vocab_size,
            train_tokens=int(train.size),
            val_tokens=int(val.size),
            train_shards=_write_split(out, "train", train, shard_tokens),
            val_shards=_write_split(out, "val", val, shard_tokens) if val.size else 0,
        )
        _write_tokenizer(out, tok.text)
        _write_json(out / META_FILE, summary.to_dict())
    except OSError as exc:
        raise DataError(f"cannot write to {out}: {exc.strerror or exc}") from exc
    return summary


def byte_summary(out: str, train: ShardStream, val: ShardStream) -> PrepareSummary:
    """Close a byte-level dataset's two streams; its summary (``out``: the dataset's path)."""
    return PrepareSummary(
        out=out,
        tokenizer=BYTE,
        vocab_size=BYTE_VOCAB,
        train_tokens=train.tokens,
        val_tokens=val.tokens,
        train_shards=train.close(),
        val_shards=val.close(),
    )


def _val_tokens(total: int, val_fraction: float) -> int:
    try:
        return val_tokens(total, val_fraction)
    except ValueError as exc:
        raise DataError(str(exc)) from None


def _existing(out: Path, overwrite: bool) -> list[Path]:
    globs = ("train*.bin", "val*.bin", "train*.mask", "val*.mask", "train*.docs", "val*.docs")
    existing = sorted(p for g in globs for p in out.glob(g)) if out.is_dir() else []
    if existing and not overwrite:
        raise DataError(
            f"output {out} already holds shards ({existing[0].name}, ...); "
            f"choose an empty folder or pass --overwrite"
        )
    return existing


def _prepare_bytes(
    files: Sequence[str | Path], out: Path, val_fraction: float, shard_tokens: int, overwrite: bool
) -> PrepareSummary:
    """Byte-level: the tokens are the files' bytes, so no text is decoded into a str and
    encoded back, and the shards are written a piece at a time (trainer.shard_stream)."""
    raws = [_read_utf8(Path(f)) for f in files]  # read all first: fail before writing anything
    total = sum(len(r) for r in raws)
    n_train = total - _val_tokens(total, val_fraction)
    existing = _existing(out, overwrite)
    streams: list[ShardStream] = []
    try:
        make_dirs(out)
        for old in existing:
            old.unlink()
        train = ShardStream(out, "train", shard_tokens)
        val = ShardStream(out, "val", shard_tokens)
        streams = [train, val]
        for raw in raws:
            for start in range(0, len(raw), _CHUNK_BYTES):
                chunk = memoryview(raw)[start : start + _CHUNK_BYTES]
                room = n_train - train.tokens
                train.append_bytes(chunk[:room])
                val.append_bytes(chunk[room:])
        summary = byte_summary(str(out), train, val)
        _write_tokenizer(out, None)
        _write_json(out / META_FILE, summary.to_dict())
    except OSError as exc:
        for stream in streams:
            stream.discard()
        raise DataError(f"cannot write to {out}: {exc.strerror or exc}") from exc
    return summary


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _write_text(path, json.dumps(obj, indent=2) + "\n")


def _write_text(path: Path, text: str) -> None:
    """Atomically: a temporary file beside ``path`` (0640), then renamed over it."""
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
        delete=False,
    ) as f:  # fmt: skip
        set_mode(f.fileno())  # a temporary file starts 0600
        f.write(text)
    Path(f.name).replace(path)


def _write_tokenizer(out: Path, text: str | None) -> None:
    """``out/tokenizer.json``: the HF tokenizer's text, or none at all for bytes (an earlier
    preparation's copy would claim the byte-level shards for that tokenizer)."""
    if text is None:
        (out / TOKENIZER_FILE).unlink(missing_ok=True)
    else:
        _write_text(out / TOKENIZER_FILE, text)


def _token_content(value: Any) -> str:
    """tokenizer_config.json writes a special token as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer_config(path: Path) -> tuple[Template, str | None]:
    """The chat template and special tokens of the ``tokenizer_config.json`` beside the
    tokenizer file (read without following a link), and its text to copy; none: defaults."""
    try:
        text = read_plain(path.parent / TOKENIZER_CONFIG, limit=1 << 24).decode("utf-8")
        config = json.loads(text)
    except FileNotFoundError:
        return Template(), None
    except (OSError, ValueError) as exc:  # not the parser's words: they would quote the file
        raise DataError(f"the tokenizer's {TOKENIZER_CONFIG} is unreadable") from exc
    if not isinstance(config, dict):
        raise DataError(f"the tokenizer's {TOKENIZER_CONFIG} is not a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name", "template"}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (
        Template(
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
        ),
        text,
    )


def prepare_sft(
    files: Sequence[str | Path],
    out: str | Path,
    fmt: str,
    *,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    tokenizer: str | Path | None = None,
    max_len: int | None = None,
    overlong: str = "drop",
    train_on_inputs: bool = False,
    overwrite: bool = False,
) -> PrepareSummary:
    """Chat or completion JSON Lines into token shards with loss masks (module docstring)."""
    if fmt not in SFT_FORMATS:
        raise DataError(f"format must be one of {', '.join(SFT_FORMATS)}, got {fmt!r}")
    if overlong not in OVERLONG:
        raise DataError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    if max_len is not None and max_len < 1:
        raise DataError(f"max_len must be >= 1, got {max_len}")
    if not files:
        raise DataError("no input files given")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if not 1 <= shard_tokens <= np.iinfo(np.int32).max:
        raise DataError(f"shard tokens must be in 1..{np.iinfo(np.int32).max}, got {shard_tokens}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} exists and is not a directory")
    tok = _HFTokenizer(Path(tokenizer)) if tokenizer is not None else None
    template, config_text = _tokenizer_config(Path(tokenizer)) if tokenizer else (Template(), None)
    # Lines are numbered across the files, in order, as if they were one.
    data = b"\n".join(_read_bytes(Path(f)).rstrip(b"\n") for f in files)
    ids, mask, report, problems = build_examples(
        read_lines(data, fmt), fmt, tok or ByteTokens(), template,
        max_len=max_len, overlong=overlong, train_on_inputs=train_on_inputs,
    )  # fmt: skip
    if problems:
        raise DataError(f"the {fmt} data has {problems.summary()}")
    if ids.size == 0:
        why = ", ".join(f"{n} {r}" for r, n in report.dropped.items()) or "no examples"
        raise DataError(f"the {fmt} data produced no tokens ({why} dropped)")
    n_val = _val_tokens(ids.size, val_fraction)
    existing = _existing(out, overwrite)
    try:
        make_dirs(out)
        for old in existing:
            old.unlink()
        cut = _example_cut(report.starts, ids.size - n_val, ids.size)
        n_val = ids.size - cut
        summary = PrepareSummary(
            out=str(out),
            tokenizer=tok.name if tok else BYTE,
            vocab_size=tok.vocab_size if tok else BYTE_VOCAB,
            train_tokens=int(cut),
            val_tokens=int(n_val),
            train_shards=_write_masked(
                out, "train", ids[:cut], mask[:cut], report.starts, shard_tokens
            ),
            val_shards=_write_masked(
                out, "val", ids[cut:], mask[cut:], report.starts - cut, shard_tokens
            ),
            sft=report.to_dict(),
        )
        _write_tokenizer(out, tok.text if tok else None)
        if config_text is not None:
            _write_text(out / TOKENIZER_CONFIG, config_text)
        else:
            (out / TOKENIZER_CONFIG).unlink(missing_ok=True)
        _write_json(out / META_FILE, summary.to_dict())
    except OSError as exc:
        raise DataError(f"cannot write to {out}: {exc.strerror or exc}") from exc
    return summary


def _example_cut(starts: np.ndarray, cut: int, total: int) -> int:
    """The start of an example nearest to token ``cut`` of ``total`` (no val split, or one
    example only: ``cut``), so that no example is split between train and val."""
    inner = starts[1:]
    if cut >= total or inner.size == 0:
        return cut
    return int(inner[np.argmin(np.abs(inner - cut))])


def _write_masked(
    out: Path,
    split: str,
    tokens: np.ndarray,
    mask: np.ndarray,
    examples: np.ndarray,
    shard_tokens: int,
) -> int:
    """Token shards, their loss masks and example starts (``examples``: offsets in
    ``tokens``, those outside it ignored), cut at the same places: at most
    ``shard_tokens`` a shard, cut at an example's start unless one example is longer."""
    n, start = 0, 0
    while start < tokens.size:
        name = f"{split}_{n:06d}.bin"
        end = min(start + shard_tokens, tokens.size)
        if end < tokens.size:  # at the last example start that fits, unless none does
            fits = examples[(examples > start) & (examples <= end)]
            end = int(fits[-1]) if fits.size else end
        write_shard(out / name, tokens[start:end])
        write_mask(out / mask_name(name), mask[start:end])
        inside = examples[(examples >= start) & (examples < end)]
        write_docs(out / docs_name(name), inside - start)
        n, start = n + 1, end
    return n


def prepare_demo(out: str | Path) -> Path:
    """Shard the bundled demo corpus (byte-level) into ``out``, replacing shards there."""
    out = Path(out)
    with resources.as_file(resources.files("trainer.assets") / "demo.txt") as demo:
        # Small shards, so the demo also exercises a split made of several shards.
        prepare([demo], out, val_fraction=0.1, shard_tokens=65_536, overwrite=True)
    return out


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.prepare",
        description="Turn UTF-8 text files into llm.c-format train/val token shards.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files, in order")
    p.add_argument("--out", required=True, help="output folder for the shards")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens for val")
    p.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard"
    )
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    p.add_argument(
        "--format", choices=("text", *SFT_FORMATS), default="text",
        help="text (default), or JSON Lines of chat conversations / prompt-completion pairs",
    )  # fmt: skip
    p.add_argument(
        "--max-len", type=int, default=None, help="chat/completion: tokens an example may have"
    )
    p.add_argument("--overlong", choices=OVERLONG, default="drop", help="an example past --max-len")
    p.add_argument("--train-on-inputs", action="store_true", help="every token carries loss")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    common = {
        "val_fraction": args.val_fraction,
        "shard_tokens": args.shard_tokens,
        "tokenizer": args.tokenizer,
        "overwrite": args.overwrite,
    }
    try:
        if args.format == "text":
            summary = prepare(args.files, args.out, **common)
        else:
            summary = prepare_sft(
                args.files, args.out, args.format, max_len=args.max_len,
                overlong=args.overlong, train_on_inputs=args.train_on_inputs, **common,
            )  # fmt: skip
    except DataError as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
