"""The preparation of one uploaded dataset, run as a child process of the API.

``python -m service.api.datasets_prepare --format text|jsonl|bin --src FILE --out DIR
--dataset-path datasets/KEY/NAME [--val-fraction F] [--tokenizer FILE] [--vocab-size N]
[--wait-go]`` (started while the upload streams in, so its imports overlap it; it begins
when ``go`` arrives on stdin, and exits doing nothing on anything else).

text and jsonl (already reduced to text by the upload's check) go through
``trainer.prepare.prepare`` as a library; bin (llm.c shards back to back, already checked)
is re-sharded: all tokens in upload order, the last ``val_fraction`` of them the val split,
as ``prepare`` splits text. The folder gets what ``prepare`` writes (shards, ``meta.json``,
``tokenizer.json`` for a Hugging Face tokenizer), with ``meta.json``'s ``out`` the dataset's
folder under the data root rather than this work folder.

The last line on stdout is one JSON object: ``{"ok": true, ...counts}`` or ``{"ok": false,
"error": "..."}`` (no work path in it). Imports numpy (and ``tokenizers`` for a Hugging Face
tokenizer), never torch, the API or a database: a crash or an out-of-memory kill here costs
the API nothing but this dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import HEADER_INTS, META_FILE, DataError, write_shard
from trainer.files import make_dirs, set_mode
from trainer.prepare import DEFAULT_SHARD_TOKENS, prepare

TOKENIZER_FILE = "tokenizer.json"


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
        "tokenizer": "byte" if tokenizer is None else TOKENIZER_FILE,
        "vocab_size": vocab_size,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_shards": _write_split(out, "train", train),
        "val_shards": _write_split(out, "val", val) if val.size else 0,
    }
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
        os.chmod(out / TOKENIZER_FILE, 0o640)
    _write_json(out / META_FILE, summary)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    src, out = Path(args.src), Path(args.out)
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if args.format == "bin":
        summary = reshard(src, out, args.val_fraction, args.vocab_size, tokenizer)
    else:
        prepared = prepare([src], out, val_fraction=args.val_fraction, tokenizer=tokenizer)
        summary = prepared.to_dict()
    summary["out"] = args.dataset_path  # where it will be, not this work folder
    _write_json(out / META_FILE, summary)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.api.datasets_prepare")
    p.add_argument("--format", choices=("text", "jsonl", "bin"), required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--wait-go", action="store_true", help="start, then wait for go on stdin")
    args = p.parse_args(argv)
    if args.wait_go and sys.stdin.readline().strip() != "go":
        return 0  # the upload failed: nothing to prepare
    try:
        result: dict[str, Any] = {"ok": True, **run(args)}
    except (DataError, OSError, ValueError) as exc:
        message = str(exc).replace(args.src, "the upload").replace(args.out, "the dataset")
        result = {"ok": False, "error": message or exc.__class__.__name__}
    except MemoryError:
        result = {"ok": False, "error": "out of memory while preparing the dataset"}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
