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

__all__ = ["BYTE", "TOKENIZER_FILE", "TokenizerError", "dataset_tokenizer"]

BYTE: Final = "byte"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"  # trainer.data.META_FILE, named here to stay free of numpy


class TokenizerError(ValueError):
    """The dataset names a tokenizer that is not there; one line."""


def dataset_tokenizer(data_dir: str | os.PathLike[str]) -> Literal["byte"] | Path:
    """``"byte"``, or the path of the Hugging Face ``tokenizer.json`` that made the shards
    in ``data_dir`` (a folder already resolved under the data root).

    A ``tokenizer.json`` in the folder wins (a link out of the folder is refused); without
    one, ``meta.json`` decides: no meta.json (shards written by hand) or ``"byte"`` is bytes,
    an absolute path (a dataset from before tokenizers were copied in) is that file if it is
    still there. TokenizerError otherwise."""
    folder = Path(data_dir)
    local = folder / TOKENIZER_FILE
    if local.is_file():
        if not local.resolve().is_relative_to(folder.resolve()):
            raise TokenizerError(f"{local} links outside its dataset folder")
        return local
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return BYTE
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{folder / META_FILE} is unreadable: {exc}") from None
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
