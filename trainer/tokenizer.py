"""Which tokenizer made a dataset: bytes, or the Hugging Face ``tokenizer.json`` in its folder.

``trainer.prepare`` writes ``meta.json`` with ``"tokenizer": "byte"``, or, with
``--tokenizer``, copies that file into the dataset as ``tokenizer.json`` and writes
``"tokenizer": "tokenizer.json"``. So ``<dataset>/tokenizer.json`` exists if and only if a
Hugging Face tokenizer made the shards: decode with it (``tokenizers.Tokenizer.from_file``),
else the ids are UTF-8 bytes (``bytes(ids).decode("utf-8", errors="replace")``).

Datasets prepared before the copy have the absolute path of the file used in ``meta.json``;
`dataset_tokenizer` still answers for them with that path while the file is there.

`special_tokens` says which tokens of a Hugging Face tokenizer are its ``bos``, ``eos`` and
``pad`` (what an export declares and where generation stops; `eos_ids` is the generation
engine's question): a ``generation_config.json``, ``tokenizer_config.json`` or
``special_tokens_map.json`` beside the tokenizer.json says so first; else the tokenizer
itself (its post-processor's template: a special token before ``$A`` is bos, after is eos;
then its special added tokens by their conventional names). Byte-level datasets have none.

Standard library only (no torch, no tokenizers): the API may ask it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

from trainer.files import read_plain

__all__ = [
    "BYTE",
    "TOKENIZER_FILE",
    "Special",
    "TokenizerError",
    "chat_template",
    "dataset_tokenizer",
    "eos_ids",
    "special_tokens",
]

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


# -- special tokens ------------------------------------------------------------------------

ROLES = ("bos", "eos", "pad")
_SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
_SIDE_LIMIT = 1 << 24  # a tokenizer_config.json with a long chat template fits
_TOKENIZER_LIMIT = 1 << 30
# Conventional names of special tokens, most specific first (Llama 3, GPT-2, SentencePiece,
# Gemma, BERT-style).
_NAMES: dict[str, tuple[str, ...]] = {
    "bos": ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "[BOS]", "[CLS]"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "[SEP]"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class Special(NamedTuple):
    """A special token: its text and its id."""

    content: str
    id: int


def _json(path: Path, limit: int) -> Any:
    """A JSON file read without following a link; None when absent or unreadable."""
    try:
        return json.loads(read_plain(path, limit=limit))
    except (OSError, ValueError):
        return None


def _ids(tok: dict[str, Any]) -> dict[str, int]:
    """Every token's id by its text: the model's vocabulary, then the added tokens."""
    out: dict[str, int] = {}
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        out.update({k: v for k, v in vocab.items() if isinstance(v, int)})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        out.update({p[0]: i for i, p in enumerate(vocab) if isinstance(p, list) and p})
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            out[str(added.get("content"))] = added["id"]
    return out


def _text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template(tok: dict[str, Any]) -> dict[str, str]:
    """bos/eos from a TemplateProcessing post-processor (alone or in a Sequence)."""
    post = tok.get("post_processor")
    steps = post.get("processors", []) if isinstance(post, dict) else []
    if isinstance(post, dict) and post.get("type") == "TemplateProcessing":
        steps = [post]
    for step in steps:
        single = step.get("single") if isinstance(step, dict) else None
        if step.get("type") != "TemplateProcessing" or not isinstance(single, list):
            continue
        kinds = [next(iter(piece), None) if isinstance(piece, dict) else None for piece in single]
        if "Sequence" not in kinds:
            continue
        at = kinds.index("Sequence")
        out = {}
        if at > 0 and kinds[0] == "SpecialToken":
            out["bos"] = single[0]["SpecialToken"].get("id")
        if at < len(single) - 1 and kinds[-1] == "SpecialToken":
            out["eos"] = single[-1]["SpecialToken"].get("id")
        return {k: v for k, v in out.items() if isinstance(v, str)}
    return {}


def special_tokens(tokenizer: str | os.PathLike[str]) -> dict[str, Special]:
    """The ``bos``, ``eos`` and ``pad`` tokens (those it has) of the Hugging Face
    ``tokenizer.json`` at ``tokenizer``, from the files beside it or from the tokenizer
    itself (see the module's notes). Nothing is followed through a link."""
    path = Path(tokenizer)
    tok = _json(path, _TOKENIZER_LIMIT)
    if not isinstance(tok, dict):
        return {}
    ids = _ids(tok)
    by_id = {v: k for k, v in ids.items()}
    found: dict[str, Special] = {}

    def take(role: str, value: Any) -> None:
        if role in found:
            return
        if isinstance(value, list) and value:  # generation_config's eos_token_id may be a list
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value in by_id:
            found[role] = Special(by_id[value], value)
        elif (text := _text(value)) is not None and text in ids:
            found[role] = Special(text, ids[text])

    side = [_json(path.with_name(name), _SIDE_LIMIT) for name in _SIDE_FILES]
    for role in ROLES:
        for raw, key in zip(
            side, (f"{role}_token_id", f"{role}_token", f"{role}_token"), strict=True
        ):
            if isinstance(raw, dict):
                take(role, raw.get(key))
    for role, text in _template(tok).items():
        take(role, text)
    special = {
        str(a.get("content")) for a in tok.get("added_tokens") or [] if isinstance(a, dict)
        if a.get("special")
    }  # fmt: skip
    for role in ROLES:
        for name in _NAMES[role]:
            if name in special:
                take(role, name)
    return found


def eos_ids(dataset_dir: str | os.PathLike[str]) -> list[int]:
    """The ids at which generation stops for a model trained on ``dataset_dir`` (resolved
    under the data root): every eos id the dataset's tokenizer declares (generation_config's
    list, or its one eos token); ``[]`` for a byte-level dataset or a tokenizer without one."""
    try:
        found = dataset_tokenizer(dataset_dir)
    except TokenizerError:
        return []
    if found == BYTE:
        return []
    gen = _json(Path(found).with_name("generation_config.json"), _SIDE_LIMIT)
    listed = gen.get("eos_token_id") if isinstance(gen, dict) else None
    if isinstance(listed, list) and all(isinstance(i, int) for i in listed) and listed:
        return [int(i) for i in listed]
    eos = special_tokens(found).get("eos")
    return [] if eos is None else [eos.id]


def chat_template(tokenizer: str | os.PathLike[str]) -> str | None:
    """The ``chat_template`` of the ``tokenizer_config.json`` beside the Hugging Face
    ``tokenizer.json`` at ``tokenizer`` (a dataset keeps the upload's), if it has one: what
    an export carries, so the model's users render chats as training did."""
    config = _json(Path(tokenizer).with_name("tokenizer_config.json"), _SIDE_LIMIT)
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) and template else None
