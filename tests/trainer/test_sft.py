"""Chat and completion data (trainer.sft, trainer.prepare.prepare_sft): the checks with their
line numbers, which tokens carry loss (against transformers' ``return_assistant_tokens_mask``
for a template with ``{% generation %}``), and the mask shards the data loader reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.chat import DEFAULT_TEMPLATE, render
from trainer.data import IGNORE_INDEX, BatchSampler, DataError, TokenDataset, write_mask
from trainer.prepare import prepare_sft
from trainer.sft_lines import LineError, check_line

SYSTEM = {"role": "system", "content": "Be brief."}


def _chat(*turns: dict[str, Any]) -> str:
    return json.dumps({"messages": list(turns)})


def _u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _a(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}


def _prepared(tmp_path: Path, lines: list[str], fmt: str = "chat", **kw: Any) -> Any:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    summary = prepare_sft([src], out, fmt, val_fraction=0.0, overwrite=True, **kw)
    ds = TokenDataset(out, "train", 1)
    assert ds.masks is not None
    return summary, np.asarray(ds.shards[0]), np.asarray(ds.masks[0])


def _targets(tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """The byte-level target runs, decoded."""
    runs, cur = [], bytearray()
    for t, m in zip(tokens.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur.decode())
            cur = bytearray()
    if cur:
        runs.append(cur.decode())
    return runs


def test_assistant_turns_carry_loss_and_weight_zero_ones_do_not(tmp_path: Path) -> None:
    lines = [
        _chat(SYSTEM, _u("Hi"), _a("Hello ✓")),
        _chat(_u("2+2?"), _a("5", weight=0), _u("Again"), _a("4", weight=1)),
    ]
    summary, tokens, mask = _prepared(tmp_path, lines)
    assert _targets(tokens, mask) == ["Hello ✓<|im_end|>\n", "4<|im_end|>\n"]
    report = summary.sft
    assert report["examples"] == 2 and report["tokens"] == tokens.size
    assert report["target_tokens"] == int(mask.sum())
    assert report["loss_share"] == pytest.approx(mask.sum() / tokens.size, abs=1e-6)
    assert report["chat_template"] == "default"
    # The text is the chat endpoint's: trainer.chat.render with the same default template.
    first = render(DEFAULT_TEMPLATE, json.loads(lines[0])["messages"], False)
    assert bytes(tokens[: len(first.encode())].astype(np.uint8)).decode() == first


def test_completion_format_and_train_on_inputs(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "Q: sky? A:", "completion": " blue"})]
    _, tokens, mask = _prepared(tmp_path, lines, fmt="completion")
    assert bytes(tokens.astype(np.uint8)) == b"Q: sky? A: blue"
    assert _targets(tokens, mask) == [" blue"]
    _, tokens, mask = _prepared(tmp_path, [_chat(_u("Hi"), _a("Yo"))], train_on_inputs=True)
    assert mask.all() and tokens.size > len("Yo")


def test_overlong_examples_are_dropped_or_truncated_and_counted(tmp_path: Path) -> None:
    short, long = _chat(_u("a"), _a("b")), _chat(_u("a" * 200), _a("b"))
    summary, tokens, _ = _prepared(tmp_path, [short, long, short], max_len=80)
    assert summary.sft["examples"] == 2 and summary.sft["dropped"] == {"too_long": 1}
    summary, tokens, mask = _prepared(tmp_path, [long], max_len=80, overlong="truncate")
    assert summary.sft["truncated"] == 1 and tokens.size == 80
    assert not mask.any()  # the answer was past the cut
    with pytest.raises(DataError, match=r"produced no tokens .*1 too_long"):
        _prepared(tmp_path, [long], max_len=80)


def test_the_report_has_the_longest_example_and_the_packing_a_job_would_get(
    tmp_path: Path,
) -> None:
    lines = [_chat(_u("q" * (3 + 7 * (i % 9))), _a("a" * (1 + i % 5))) for i in range(40)]
    summary, _, _ = _prepared(tmp_path, lines)
    report = summary.sft
    lengths = [len(render(DEFAULT_TEMPLATE, json.loads(line)["messages"], False).encode())
               for line in lines]  # fmt: skip
    assert report["longest"] == max(lengths) and report["packing_seq_len"] == max(lengths) - 1
    packed = TokenDataset(tmp_path / "out", "train", report["packing_seq_len"], packing=True)
    assert packed.examples == 40
    assert report["packing_efficiency"] == pytest.approx(packed.efficiency, abs=1e-6)
    assert 0.3 < report["packing_efficiency"] < 1.0
    # With max_len, at max_len - 1: what a job of that seq_len packs.
    summary, _, _ = _prepared(tmp_path, lines, max_len=400)
    packed = TokenDataset(tmp_path / "out", "train", 399, packing=True)
    assert summary.sft["packing_seq_len"] == 399
    assert summary.sft["packing_efficiency"] == pytest.approx(packed.efficiency, abs=1e-6)


def test_bad_lines_are_listed_with_their_numbers_and_reasons(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(
        b"\n".join(
            [
                _chat(_u("fine"), _a("ok")).encode(),
                _chat({"role": "bot", "content": "x"}, _a("y")).encode(),
                b"",
                _chat(SYSTEM, _u("no answer")).encode(),
                _chat(_u("   "), _a("y")).encode(),
                b'{"messages": [',
                b'{"messages": "\xff"}',
                b"not even close",
            ]
        )
    )
    with pytest.raises(DataError) as err:
        prepare_sft([src], tmp_path / "out", "chat")
    text = str(err.value)
    assert "6 bad line(s)" not in text  # collection stops at the first five
    assert '5 bad line(s): line 2: messages[0] has role "bot"' in text
    assert "line 4: has no assistant message" in text
    assert "line 5: messages[0] (user) has empty content" in text
    assert "line 6: is not JSON" in text
    assert "line 7: is not UTF-8 (byte 0xff)" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("fmt", "line", "reason"),
    [
        ("chat", _chat(_u("x"), _a("y", weight=2)), "bad_weight"),
        ("chat", _chat({**_u("x"), "weight": 0}, _a("y")), "bad_weight"),
        ("chat", json.dumps({"messages": []}), "bad_shape"),
        ("chat", json.dumps({"messages": [{"role": "user", "content": 3}]}), "bad_shape"),
        ("completion", json.dumps({"prompt": "p"}), "bad_shape"),
        ("completion", json.dumps({"prompt": "p", "completion": ""}), "empty_content"),
        (
            "chat",
            '{"messages": [{"role": "user", "content": "\\ud800"}, '
            '{"role": "assistant", "content": "y"}]}',
            "not_utf8",
        ),
        ("chat", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "malformed_json"),
    ],
)
def test_each_check_has_its_reason(fmt: str, line: str, reason: str) -> None:
    with pytest.raises(LineError) as err:
        check_line(fmt, line.encode())
    assert err.value.reason == reason


def test_generation_markers_mask_as_transformers_does(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    )
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials)
    tok.train_from_iterator(["user assistant system the quick brown fox jumps over"] * 30, trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [SYSTEM, _u("the quick fox"), _a("jumps over"), _u("brown"), _a("the fox")]
    src = tmp_path / "c.jsonl"
    src.write_text(_chat(*messages) + "\n")
    out = tmp_path / "out"
    prepare_sft([src], out, "chat", tokenizer=folder / "tokenizer.json", val_fraction=0.0)
    ds = TokenDataset(out, "train", 1)
    assert ds.masks is not None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = template
    ref = fast.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert np.asarray(ds.shards[0]).tolist() == list(ref["input_ids"])
    assert np.asarray(ds.masks[0]).tolist() == list(ref["assistant_masks"])
    assert sum(ref["assistant_masks"]) > 0
    # The tokenizer's config travels with the dataset: serving renders as training did.
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    assert json.loads((out / "meta.json").read_text())["sft"]["chat_template"] == "tokenizer"


def test_the_loader_ignores_non_targets_and_masks_follow_the_shard_rules(tmp_path: Path) -> None:
    _, tokens, _ = _prepared(tmp_path, [_chat(_u("Hi there"), _a("Hello"))] * 4)
    out = tmp_path / "out"
    ds = TokenDataset(out, "train", 15)
    sampler = BatchSampler(ds, len(ds), 1, 0, 1, seed=0)  # every window
    x, y = sampler.batch(0, 0)
    windows = ds.gather(sampler.indices(0, 0)).astype(np.int64)
    masks = ds.gather_mask(sampler.indices(0, 0))
    assert masks is not None
    expect = np.where(masks[:, 1:] == 1, windows[:, 1:], IGNORE_INDEX)
    assert y.numpy().tolist() == expect.tolist()
    assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()
    assert x.numpy().tolist() == windows[:, :-1].tolist()

    mask_file = out / "train_000000.mask"
    real = out / "elsewhere.mask"
    mask_file.rename(real)
    os.symlink(real.name, mask_file)
    with pytest.raises(DataError, match="never through a link"):
        TokenDataset(out, "train", 15)
    mask_file.unlink()
    write_mask(mask_file, np.ones(tokens.size - 1, dtype=np.uint8))
    with pytest.raises(DataError, match="not a loss mask of its shard's"):
        TokenDataset(out, "train", 15)
    mask_file.unlink()
    assert TokenDataset(out, "train", 15).masks is None  # none at all: every token a target
    write_mask(out / "train_000001.mask", np.ones(tokens.size, dtype=np.uint8))
    (out / "train_000001.bin").write_bytes((out / "train_000000.bin").read_bytes())
    with pytest.raises(DataError, match="some train shards have a loss mask"):
        TokenDataset(out, "train", 15)
