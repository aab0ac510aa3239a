"""Packing without cross-talk (trainer.data ``packing``; the models' ``doc`` argument).

- Packed and unpacked give the same per-example losses (1e-5) for gpt, llama and a tiny
  Qwen2 (family hf): each example alone, unpadded, against its share of a packed row.
- Changing one example's tokens changes no other example's logits in the same row.
- The example starts (.docs) written by prepare_sft, overlong examples dropped or cut as the
  dataset says, a link refused, a dataset without starts refused; one document a row is the
  plain causal path.
- A packed run trains over epochs, reports its efficiency, and resumes mid-epoch exactly;
  2 ranks with accumulation equal one process (loss, grad norm, packed val loss).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.trainer import runs
from trainer.config import HFModelConfig, LlamaConfig, ModelConfig, load_config
from trainer.data import IGNORE_INDEX, BatchSampler, DataError, TokenDataset, open_docs
from trainer.models import build_model
from trainer.prepare import prepare_sft

SEQ = 48


def _completions(path: Path, n: int = 40, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = runs.WORDS
    lines = []
    for _ in range(n):
        prompt = " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(1, 4)))
        answer = " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(1, 3)))
        lines.append(json.dumps({"prompt": prompt + "? ", "completion": answer}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _dataset(tmp_path: Path, **kw: Any) -> Path:
    src = _completions(tmp_path / "c.jsonl", **kw)
    out = tmp_path / "root" / "c"
    prepare_sft([src], out, "completion", val_fraction=0.0, shard_tokens=400)
    return out


def _qwen2(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _model(family: str, tmp_path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        cfg: Any = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=SEQ, vocab_size=256)
    elif family == "llama":
        cfg = LlamaConfig(
            family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=SEQ,
            vocab_size=256,
        )  # fmt: skip
    else:
        path = _qwen2(tmp_path / "qwen2")
        cfg = HFModelConfig(family="hf", path=str(path), seq_len=SEQ)
    model = build_model(cfg)
    model.init_weights()
    return model.eval()


def _examples(ds: TokenDataset, row: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Row ``row``'s examples as stored: tokens and loss mask."""
    first, last = ds._row_first[row], ds._row_first[row + 1]
    out = []
    for k, a, n, _ in ds._seg[:, first:last].T.tolist():
        assert ds.masks is not None
        out.append((np.asarray(ds.shards[k][a : a + n]), np.asarray(ds.masks[k][a : a + n])))
    return out


@pytest.mark.parametrize("family", ["gpt", "llama", "hf"])
def test_packed_and_unpacked_give_the_same_per_example_losses(tmp_path: Path, family: str) -> None:
    ds = TokenDataset(_dataset(tmp_path), "train", SEQ, packing=True)
    assert ds.num_samples < ds.examples / 2  # rows really hold several examples
    model = _model(family, tmp_path)
    rows = np.arange(min(4, ds.num_samples))
    x, y, doc = (torch.from_numpy(a) for a in ds.gather_packed(rows))
    with torch.no_grad():
        per = F.cross_entropy(
            model(x, doc=doc).float().transpose(1, 2), y, ignore_index=IGNORE_INDEX,
            reduction="none",
        )  # fmt: skip
    checked = 0
    for r in rows.tolist():
        for d, (tokens, mask) in enumerate(_examples(ds, r)):
            ids = torch.from_numpy(tokens.astype(np.int64))[None]
            target = ids[:, 1:].masked_fill(torch.from_numpy(mask[1:] == 0)[None], IGNORE_INDEX)
            with torch.no_grad():
                alone = F.cross_entropy(
                    model(ids[:, :-1]).float().transpose(1, 2), target,
                    ignore_index=IGNORE_INDEX, reduction="sum",
                )  # fmt: skip
            packed = per[r][doc[r] == d].sum()
            assert float(packed) == pytest.approx(float(alone), abs=1e-5, rel=0)
            assert float(alone) > 0  # the example has targets: the check compares something
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("family", ["gpt", "llama", "hf"])
def test_no_attention_crosses_an_example(tmp_path: Path, family: str) -> None:
    ds = TokenDataset(_dataset(tmp_path), "train", SEQ, packing=True)
    model = _model(family, tmp_path)
    x, _, doc = (torch.from_numpy(a) for a in ds.gather_packed(np.array([0])))
    assert int(doc.max()) >= 2  # two examples and the padding at least
    changed = x.clone()
    changed[doc == 0] = (changed[doc == 0] + 7) % 256  # the first example, other tokens
    with torch.no_grad():
        a, b = model(x, doc=doc), model(changed, doc=doc)
        plain = model(changed)  # without doc ids: causal attention across the row
    own, others = doc[0] == 0, doc[0] != 0
    assert not torch.allclose(a[0][own], b[0][own])
    torch.testing.assert_close(a[0][others], b[0][others], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0][others], plain[0][others], atol=1e-4)


def test_one_document_a_row_is_the_plain_causal_path(tmp_path: Path) -> None:
    """Rows of one example filling the whole window: the masked path (doc ids, explicit
    block-diagonal mask, positions from the ids) gives the plain causal path's logits."""
    for family in ("gpt", "llama"):
        model = _model(family, tmp_path)
        x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            one_doc = model(x, doc=torch.zeros_like(x))
            plain = model(x)
        torch.testing.assert_close(one_doc, plain, rtol=0, atol=1e-5)


def test_prepare_writes_example_starts_and_overlong_ones_follow_the_dataset(
    tmp_path: Path,
) -> None:
    out = _dataset(tmp_path, n=60)
    meta = json.loads((out / "meta.json").read_text())
    shards = sorted(out.glob("train_*.bin"))
    assert len(shards) > 1 and len(sorted(out.glob("train_*.docs"))) == len(shards)
    total = 0
    for shard in shards:
        count = (shard.stat().st_size - 1024) // 2
        starts = open_docs(shard, count)
        assert starts is not None and starts[0] == 0 and starts[-1] < count  # cut between
        total += starts.size
    assert total == meta["sft"]["examples"]  # every example starts exactly once

    small = 15  # some examples are longer than small + 1 tokens, some not
    dropped = TokenDataset(out, "train", small, packing=True)
    assert dropped.pack_dropped > 0 and dropped.pack_truncated == 0
    meta["sft"]["overlong"] = "truncate"
    (out / "meta.json").write_text(json.dumps(meta))
    cut = TokenDataset(out, "train", small, packing=True)
    assert cut.pack_truncated == dropped.pack_dropped and cut.pack_dropped == 0
    assert cut.examples == dropped.examples + dropped.pack_dropped
    assert 0.5 < cut.efficiency <= 1.0


def test_packing_refuses_data_without_starts_and_links(tmp_path: Path) -> None:
    runs.write_corpus(tmp_path)
    with pytest.raises(DataError, match=r"data\.packing needs the examples' boundaries"):
        TokenDataset(tmp_path / "tiny", "train", SEQ, packing=True)
    out = _dataset(tmp_path)
    docs = out / "train_000000.docs"
    docs.rename(out / "elsewhere")
    os.symlink(out / "elsewhere", docs)
    with pytest.raises(DataError, match="never through a link"):
        TokenDataset(out, "train", SEQ, packing=True, label="c")
    docs.unlink()
    (out / "elsewhere").rename(docs)
    docs.write_bytes(docs.read_bytes()[:-4] + b"\xff\xff\xff\x7f")  # past the shard
    with pytest.raises(DataError, match="not increasing offsets inside"):
        TokenDataset(out, "train", SEQ, packing=True)


def _run_cfg(steps: int, every: int) -> dict[str, Any]:
    return runs.config(
        steps=steps,
        data={"path": "c", "packing": True},
        model={"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": SEQ, "vocab_size": 256},
        batch={"micro_batch_size": 2, "grad_accum_steps": 2},
        optim={"lr": 3e-2},
        eval={"every": 0},
        checkpoint={"every": every, "keep": 1000},
    )


def test_a_packed_run_trains_over_epochs_and_resumes_mid_epoch_exactly(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    out = _dataset(tmp_path)
    data_root = out.parent
    ds = TokenDataset(out, "train", SEQ, packing=True)
    steps = (3 * ds.num_samples) // 4 + 1  # 4 rows a step: about three epochs
    mid = ds.num_samples // 4 + 1  # a checkpoint in the second epoch, not at its start
    assert (mid * 4) % ds.num_samples != 0 and mid * 4 > ds.num_samples
    cfg = _run_cfg(steps, every=mid)
    run_dir = tmp_path / "run"
    code, text = runs.run(cfg, run_dir, data_root, subprocess_env, nproc=1)
    assert code == 0, text
    assert "packing:" in text and "efficiency" in text
    straight = runs.losses(run_dir)
    # Back to the checkpoint at ``mid``, as if the run had died after it: the rest again.
    for ckpt in (run_dir / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > mid:
            shutil.rmtree(ckpt)
    (run_dir / "metrics.jsonl").unlink()
    code, text = runs.run(cfg, run_dir, data_root, subprocess_env, nproc=1)
    assert code == 0, text
    assert f"at step {mid}" in text
    resumed = runs.losses(run_dir)
    assert sorted(resumed) == list(range(mid + 1, steps + 1))
    assert [resumed[s] for s in resumed] == [straight[s] for s in resumed]
    a = straight
    # the first step's loss: the packed rows' target mean under the seeded model
    from trainer.train import _seeded_model

    model = _seeded_model(load_config(cfg), tmp_path / "none")
    sampler = BatchSampler(ds, 2, 2, 0, 1, load_config(cfg).seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for micro in range(2):
            x, y, doc = sampler.batch(0, micro)
            logits = model(x, doc=doc).float()
            total += float(F.cross_entropy(logits.transpose(1, 2), y, reduction="sum"))
            count += int((y != IGNORE_INDEX).sum())
    assert a[1] == pytest.approx(total / count, abs=1e-5, rel=0)
    assert a[steps] < a[1]


def test_packed_two_ranks_with_accumulation_equal_one_process(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Rows are dealt rank-strided as windows are: 2 ranks x 2 micro-batches of 1 row give
    one process's 2 x 2 (the same loss and gradients; the same val rows, the same val loss)."""
    src = _completions(tmp_path / "c.jsonl", n=60)
    out = tmp_path / "root" / "c"
    prepare_sft([src], out, "completion", val_fraction=0.2, shard_tokens=400)
    val = TokenDataset(out, "val", SEQ, packing=True)
    for path, shard in zip(val.paths, val.shards, strict=True):  # cut at an example's start
        starts = open_docs(path, int(shard.shape[0]))
        assert starts is not None and starts[0] == 0
    assert val.examples >= 2 and (val.efficiency > 0.5 or val.num_samples == 1)
    cfgs = []
    for batch in ({"micro_batch_size": 2, "grad_accum_steps": 2},
                  {"micro_batch_size": 1, "grad_accum_steps": 2}):  # fmt: skip
        cfg = _run_cfg(4, every=0)
        cfg["batch"], cfg["eval"] = batch, {"every": 2, "steps": 1}
        cfgs.append(cfg)
    code, text = runs.run(cfgs[0], tmp_path / "one", out.parent, subprocess_env, nproc=1)
    assert code == 0, text
    code, text = runs.run(cfgs[1], tmp_path / "two", out.parent, subprocess_env, nproc=2)
    assert code == 0, text
    a, b = runs.metrics(tmp_path / "one"), runs.metrics(tmp_path / "two")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1e-4)
    val_a = [m["val_loss"] for m in a if m.get("val_loss") is not None]
    val_b = [m["val_loss"] for m in b if m.get("val_loss") is not None]
    assert len(val_a) == 2 and val_b == pytest.approx(val_a, rel=1e-5)
