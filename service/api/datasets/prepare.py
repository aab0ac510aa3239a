"""The preparation of one uploaded dataset, run as a child process of the API.

``python -m service.api.datasets.prepare --format text|jsonl|bin|chat|completion --src FILE
--out DIR --dataset-path datasets/KEY/NAME [--val-fraction F] [--tokenizer FILE]
[--vocab-size N] [--wait-go] [--shard-tokens N] [--max-len N] [--overlong drop|truncate]
[--train-on-inputs]`` (started while the upload streams in, so its imports
overlap it; it begins when ``go`` arrives on stdin, and exits doing nothing on anything
else).

Byte-level text and jsonl (already reduced to text by the upload's check) started with
``--wait-go`` are prepared while they arrive: the child follows the upload's file as it
grows, turning each piece into tokens appended to the train shards
(``trainer.shard_stream``); at ``go`` (the upload complete and checked) it reads to the
end, moves the last ``val_fraction`` of the tokens to the val shards and writes the
headers, so ``ready`` follows the last byte closely. The shards are byte for byte what
``trainer.prepare.prepare`` writes for the same file. Anything but ``go`` (``stop``, or
stdin closed) ends it with nothing printed. Otherwise (a Hugging Face tokenizer, or no
warm child) text and jsonl go through ``trainer.prepare.prepare`` as a library, chat and
completion (the upload's lines, already checked) through ``trainer.prepare.prepare_sft``
(its ``sft`` report is in the result, and becomes the dataset's ``report``); bin
(llm.c shards back to back, already checked) is re-sharded: all tokens in upload order,
the last ``val_fraction`` of them the val split, as ``prepare`` splits text. The folder
gets what ``prepare`` writes (shards, ``meta.json``, ``tokenizer.json`` for a Hugging Face
tokenizer), with ``meta.json``'s ``out`` the dataset's folder under the data root rather
than this work folder.

The last line on stdout is one JSON object: ``{"ok": true, ...counts}`` or ``{"ok": false,
"error": "..."}`` (no work path in it). Imports numpy (and ``tokenizers`` for a Hugging Face
tokenizer), never torch, the API or a database: a crash or an out-of-memory kill here costs
the API nothing but this dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import HEADER_INTS, META_FILE, DataError, write_shard
from trainer.files import make_dirs, read_plain, set_mode
from trainer.prepare import DEFAULT_SHARD_TOKENS, byte_summary, prepare, prepare_sft
from trainer.sft import OVERLONG, SFT_FORMATS
from trainer.shard_stream import ShardStream, val_tokens
from trainer.tokenizer import BYTE, TOKENIZER_FILE


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    set_mode(fd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _split(tokens: np.ndarray, val_fraction: float) -> int:
    n_val = round(tokens.size * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= tokens.size:
        raise DataError(
            f"{tokens.size} tokens are too few to split off a val fraction of {val_fraction}"
        )
    return int(n_val)


def _write_split(out: Path, split: str, tokens: np.ndarray) -> int:
    starts = range(0, tokens.size, DEFAULT_SHARD_TOKENS)
    for n, start in enumerate(starts):
        write_shard(out / f"{split}_{n:06d}.bin", tokens[start : start + DEFAULT_SHARD_TOKENS])
    return len(starts)


def reshard(
    src: Path, out: Path, val_fraction: float, vocab_size: int, tokenizer: Path | None
) -> dict[str, Any]:
    """Shards back to back in ``src`` into train/val shards in ``out``; the summary."""
    size = src.stat().st_size
    parts, offset = [], 0
    while offset < size:
        count = int(np.fromfile(src, dtype="<i4", count=HEADER_INTS, offset=offset)[2])
        start = offset + HEADER_INTS * 4
        parts.append(np.memmap(src, dtype="<u2", mode="r", offset=start, shape=(count,)))
        offset = start + 2 * count
    tokens = np.concatenate(parts)
    n_val = _split(tokens, val_fraction)
    make_dirs(out)
    train, val = tokens[: tokens.size - n_val], tokens[tokens.size - n_val :]
    summary = {
        "out": str(out),
        "tokenizer": BYTE if tokenizer is None else TOKENIZER_FILE,
        "vocab_size": vocab_size,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_shards": _write_split(out, "train", train),
        "val_shards": _write_split(out, "val", val) if val.size else 0,
    }
    if tokenizer is not None:  # read as the trainer reads: a regular file, never a link
        (out / TOKENIZER_FILE).write_bytes(read_plain(tokenizer))
        os.chmod(out / TOKENIZER_FILE, 0o640)
    _write_json(out / META_FILE, summary)
    return summary


# Following an upload: read in pieces this size; look at stdin this often when caught up;
# fsync what was written when caught up with more than this unsynced.
_FOLLOW_BYTES = 1 << 22
_FOLLOW_WAIT_S = 0.02
_SYNC_BYTES = 1 << 25


class _Stdin:
    """``go`` or anything else, on stdin, looked at without blocking."""

    def __init__(self) -> None:
        self._buf = b""
        self.said: str | None = None  # the first line, once it came (or "" at end of input)

    def poll(self, timeout: float) -> str | None:
        if self.said is None and select.select([0], [], [], timeout)[0]:
            data = os.read(0, 64)
            self._buf += data
            if b"\n" in self._buf or not data:
                self.said = self._buf.split(b"\n", 1)[0].decode("ascii", "replace").strip()
        return self.said


def follow(args: argparse.Namespace, stdin: _Stdin) -> dict[str, Any] | None:
    """Byte-level preparation while the upload arrives; None if called off."""
    src, out = Path(args.src), Path(args.out)
    while not src.exists():  # the API creates it just after starting this process
        if stdin.poll(_FOLLOW_WAIT_S) is not None and not src.exists():
            return None
    train = ShardStream(out, "train", args.shard_tokens)
    val = ShardStream(out, "val", args.shard_tokens)
    try:
        with src.open("rb", buffering=0) as f:
            while True:
                data = f.read(_FOLLOW_BYTES)
                if data:
                    train.append_bytes(data)
                    continue
                said = stdin.said
                if said is not None:  # said before this read, which found the end
                    break
                train.sync(_SYNC_BYTES)
                stdin.poll(_FOLLOW_WAIT_S)
        if said != "go":
            train.discard()
            return None
        total = train.tokens
        if total == 0:
            raise DataError("the input files produced no tokens")
        train.move_tail(total - val_tokens(total, args.val_fraction), val)
        # ``out``: where the dataset will be, not this work folder.
        summary = byte_summary(args.dataset_path, train, val).to_dict()
    except BaseException:
        train.discard()
        val.discard()
        raise
    _write_json(out / META_FILE, summary)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    src, out = Path(args.src), Path(args.out)
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if args.format == "bin":
        summary = reshard(src, out, args.val_fraction, args.vocab_size, tokenizer)
    elif args.format in SFT_FORMATS:
        summary = prepare_sft(
            [src], out, args.format, val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens, tokenizer=tokenizer, max_len=args.max_len,
            overlong=args.overlong, train_on_inputs=args.train_on_inputs,
        ).to_dict()  # fmt: skip
    else:
        prepared = prepare(
            [src],
            out,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            tokenizer=tokenizer,
        )
        summary = prepared.to_dict()
    summary["out"] = args.dataset_path  # where it will be, not this work folder
    _write_json(out / META_FILE, summary)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.api.datasets.prepare")
    p.add_argument("--format", choices=("text", "jsonl", "bin", *SFT_FORMATS), required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--wait-go", action="store_true", help="start, then wait for go on stdin")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--overlong", choices=OVERLONG, default="drop")
    p.add_argument("--train-on-inputs", action="store_true")
    args = p.parse_args(argv)
    streamed = args.wait_go and args.format in ("text", "jsonl") and not args.tokenizer
    try:
        if streamed:
            followed = follow(args, _Stdin())
            if followed is None:
                return 0  # the upload failed: nothing to prepare
            result: dict[str, Any] = {"ok": True, **followed}
        else:
            if args.wait_go and sys.stdin.readline().strip() != "go":
                return 0  # the upload failed: nothing to prepare
            result = {"ok": True, **run(args)}
    except (DataError, OSError, ValueError) as exc:
        message = str(exc).replace(args.src, "the upload").replace(args.out, "the dataset")
        if args.tokenizer:  # named as the tokenizer, never by its absolute path
            tok = args.tokenizer
            message = message.replace(f"tokenizer file {tok}", "the tokenizer").replace(
                tok, "the tokenizer"
            )
        result = {"ok": False, "error": message or exc.__class__.__name__}
    except MemoryError:
        result = {"ok": False, "error": "out of memory while preparing the dataset"}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
