"""trainer.tokenizer.special_tokens and eos_ids: which tokens of a dataset's Hugging Face
tokenizer are bos, eos and pad (what exports declare and where generation stops), read from
the files beside it or from the tokenizer itself, with no link followed. Tokenizers are
built here with the tokenizers library (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.tokenizer import Special, eos_ids, special_tokens

pytest.importorskip("tokenizers")


def _tokenizer(folder: Path, specials: list[str], template: bool = False) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["a", "b", "c", "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    if template:
        ids = {s: tok.token_to_id(s) for s in specials}
        tok.post_processor = processors.TemplateProcessing(
            single="[START] $A [STOP]", special_tokens=[(s, ids[s]) for s in specials]
        )
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_conventional_names_and_templates_say_which_is_which(tmp_path: Path) -> None:
    path = _tokenizer(tmp_path / "named", ["<s>", "</s>", "<pad>"])
    assert special_tokens(path) == {
        "bos": Special("<s>", 4),
        "eos": Special("</s>", 5),
        "pad": Special("<pad>", 6),
    }
    assert eos_ids(path.parent) == [5]
    # Names nobody uses: the post-processor's template says what wraps a sequence.
    path = _tokenizer(tmp_path / "template", ["[START]", "[STOP]"], template=True)
    assert special_tokens(path) == {"bos": Special("[START]", 4), "eos": Special("[STOP]", 5)}
    assert special_tokens(_tokenizer(tmp_path / "plain", [])) == {}
    assert eos_ids(tmp_path / "plain") == []


def test_files_beside_the_tokenizer_win(tmp_path: Path) -> None:
    path = _tokenizer(tmp_path / "d", ["<s>", "</s>", "<|im_end|>"])
    (path.parent / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>"}, "pad_token": "</s>"})
    )
    assert special_tokens(path) == {
        "bos": Special("<s>", 4),
        "eos": Special("<|im_end|>", 6),
        "pad": Special("</s>", 5),
    }
    assert eos_ids(path.parent) == [6]
    # generation_config.json's list of eos ids is what generation stops at.
    (path.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 5]}))
    assert eos_ids(path.parent) == [6, 5]
    assert special_tokens(path)["eos"] == Special("<|im_end|>", 6)


def test_a_linked_side_file_is_not_read_and_bytes_have_no_eos(tmp_path: Path) -> None:
    path = _tokenizer(tmp_path / "d", ["<s>", "</s>"])
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"eos_token": "<s>"}))
    (path.parent / "tokenizer_config.json").symlink_to(elsewhere)
    assert special_tokens(path)["eos"] == Special("</s>", 5)
    byte = tmp_path / "bytes"
    byte.mkdir()
    (byte / "meta.json").write_text(json.dumps({"tokenizer": "byte"}))
    assert eos_ids(byte) == []
    (byte / "meta.json").write_text(json.dumps({"tokenizer": str(tmp_path / "gone.json")}))
    assert eos_ids(byte) == []  # a tokenizer that is not there: nothing claimed
