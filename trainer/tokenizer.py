"""Which tokenizer made a dataset: bytes, or the Hugging Face ``tokenizer.json`` in its folder.

``trainer.prepare`` writes ``meta.json`` with ``"tokenizer": "byte"``, or, with
``--tokenizer``, copies that file into the dataset as ``tokenizer.json`` and writes
``"tokenizer": "tokenizer.json"``. So ``<dataset>/tokenizer.json`` exists if and only if a
Hugging Face tokenizer made the shards: decode with it (``tokenizers.Tokenizer.from_file``),
else the ids are UTF-8 bytes (``bytes(ids).decode("utf-8", errors="replace")``).

Datasets prepared before the copy have the absolute path of the file used in ``meta.json``;
`dataset_tokenizer` still answers for them with that path while the file is there.

Standard library only (no torch, no tokenizers): the API may ask it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final, Literal

from trainer.files import read_plain

__all__ = ["BYTE", "TOKENIZER_FILE", "TokenizerError", "dataset_tokenizer"]

BYTE: Final = "byte"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"  # trainer.data.META_FILE, named here to stay free of numpy


class TokenizerError(ValueError):
    """The dataset names a tokenizer that is not there; one line."""


def dataset_tokenizer(data_dir: str | os.PathLike[str]) -> Literal["byte"] | Path:
    """``"byte"``, or the path of the Hugging Face ``tokenizer.json`` that made the shards
    in ``data_dir`` (a folder already resolved under the data root).

    A ``tokenizer.json`` in the folder wins (a link is refused, never followed); without
    one, ``meta.json`` (read without following a link) decides: no meta.json (shards
    written by hand) or ``"byte"`` is bytes, an absolute path (a dataset from before
    tokenizers were copied in) is that file if it is still there. TokenizerError otherwise."""
    folder = Path(data_dir)
    local = folder / TOKENIZER_FILE
    if local.is_symlink():
        raise TokenizerError(f"dataset {folder.name}: its {TOKENIZER_FILE} is a symbolic link")
    if local.is_file():
        return local
    try:
        meta = json.loads(read_plain(folder / META_FILE, limit=1 << 20))
    except FileNotFoundError:
        return BYTE
    except (OSError, ValueError):  # not its parser's words: they would quote the file
        raise TokenizerError(f"dataset {folder.name}: its {META_FILE} is unreadable") from None
    name = meta.get("tokenizer", BYTE) if isinstance(meta, dict) else BYTE
    if name == BYTE:
        return BYTE
    old = Path(str(name))
    if old.is_absolute() and old.is_file():
        return old
    raise TokenizerError(
        f"dataset {folder.name} was tokenized with {name!r}, which it does not hold as "
        f"{TOKENIZER_FILE}: prepare it again (trainer.prepare copies the tokenizer in)"
    )
