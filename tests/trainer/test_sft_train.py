"""Loss on targets only, normalized by the step's target tokens: real trainer runs (CPU).

- A chat dataset (``trainer.prepare.prepare_sft``) trained by a real run: its first step's
  loss is the mean over the assistant tokens of the batch, computed here from the same
  seeded model, and not the mean over all tokens (user and system tokens do not enter it).
- One step of 2 ranks (torchrun, gloo) x 4 micro-batches of 1 window equals one process
  with a batch of all 8, on windows with very different target counts; the old formula
  (the mean of the micro-batches' means) is computed from the same model and differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.trainer import runs
from trainer.checkpoint import load_checkpoint
from trainer.config import load_config
from trainer.data import IGNORE_INDEX, BatchSampler, TokenDataset, write_mask, write_shard
from trainer.prepare import prepare_sft
from trainer.train import _seeded_model, build_optimizer

SEQ = 32


def _cfg(data: str, batch: dict[str, int], steps: int = 2, every: int = 0) -> dict[str, Any]:
    return runs.config(
        steps=steps,
        data={"path": data},
        model={"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": SEQ, "vocab_size": 256},
        batch=batch,
        optim={"lr": 3e-2},
        eval={"every": 0},
        checkpoint={"every": every, "keep": 2},
    )


def _window_losses(
    cfg: dict[str, Any], run_dir: Path, folder: Path, n: int, step: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step ``step``'s ``n`` windows (one process, micro batch n) under the model the run
    had then (the seeded one, or its checkpoint ``step-{step}``): each window's sum of
    target losses, its target count, and its all-token mean."""
    config = load_config(cfg)
    model = _seeded_model(config, run_dir / "none")
    if step:
        optimizer = build_optimizer(model, config.optim)
        ckpt = run_dir / "checkpoints" / f"step-{step}"
        cpu = torch.device("cpu")
        load_checkpoint(ckpt, model, optimizer, None, strategy="single", rank=0, device=cpu)
    sampler = BatchSampler(TokenDataset(folder, "train", SEQ), n, 1, 0, 1, config.seed)
    x, y = sampler.batch(step, 0)
    windows = sampler.dataset.gather(sampler.indices(step, 0))
    full = torch.from_numpy(windows[:, 1:].astype(np.int64))
    with torch.no_grad():
        logits = model(x).float()
        per = F.cross_entropy(
            logits.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none"
        )
        every = F.cross_entropy(logits.transpose(1, 2), full, reduction="none")
    counts = (y != IGNORE_INDEX).sum(1)
    return per.sum(1).double().numpy(), counts.numpy(), every.mean(1).double().numpy()


def _first(run_dir: Path) -> dict[str, Any]:
    return runs.metrics(run_dir)[0]


def test_a_chat_run_takes_its_loss_on_assistant_tokens_only(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    rng = np.random.default_rng(3)
    words = runs.WORDS
    lines = []
    for _ in range(60):
        question = " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(3, 12)))
        answer = " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(1, 6)))
        messages = [
            {"role": "system", "content": "Answer in words."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        lines.append(json.dumps({"messages": messages}))
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(lines) + "\n")
    data_root = tmp_path / "root"
    summary = prepare_sft([src], data_root / "chat", "chat", val_fraction=0.1)
    assert summary.sft is not None and 0.05 < summary.sft["loss_share"] < 0.5

    cfg = _cfg("chat", {"micro_batch_size": 8, "grad_accum_steps": 1})
    code, out = runs.run(cfg, tmp_path / "run", data_root, subprocess_env, nproc=1)
    assert code == 0, out
    sums, counts, every = _window_losses(cfg, tmp_path / "w", data_root / "chat", 8)
    assert 0 < counts.sum() < counts.size * SEQ  # some tokens are no target
    masked_mean = sums.sum() / counts.sum()
    assert _first(tmp_path / "run")["loss"] == pytest.approx(masked_mean, abs=1e-5, rel=0)
    # All tokens' mean (the user's and the system's in it) is 100x the tolerance away, even
    # at init, where every prediction is near uniform (~ln 256).
    assert abs(every.mean() - masked_mean) > 1e-3


def _uneven(folder: Path) -> None:
    """Word-salad tokens with a loss mask whose target count differs from window to
    window: window w (SEQ+1 tokens) has targets at its last 1 + (7 * w) % SEQ positions."""
    rng = np.random.default_rng(0)
    text = " ".join(runs.WORDS[i] for i in rng.integers(0, len(runs.WORDS), 900)).encode()
    tokens = np.frombuffer(text, dtype=np.uint8)
    window = SEQ + 1
    n = tokens.size // window
    mask = np.zeros(tokens.size, dtype=np.uint8)
    for w in range(n):
        k = (2, 6, SEQ)[w % 3]
        mask[(w + 1) * window - k : (w + 1) * window] = 1
    write_shard(folder / "train_000.bin", tokens)
    write_mask(folder / "train_000.mask", mask)


def test_accumulation_on_two_ranks_equals_one_batch_on_one_process(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    data_root = tmp_path / "root"
    _uneven(data_root / "uneven")
    # Steps 1-5 agree: the same gradients every step (a checkpoint at 4 for the check below).
    one = _cfg("uneven", {"micro_batch_size": 8, "grad_accum_steps": 1}, steps=5, every=4)
    split = _cfg("uneven", {"micro_batch_size": 1, "grad_accum_steps": 4}, steps=5)
    code, out = runs.run(one, tmp_path / "one", data_root, subprocess_env, nproc=1)
    assert code == 0, out
    code, out = runs.run(split, tmp_path / "split", data_root, subprocess_env, nproc=2)
    assert code == 0, out
    a, b = runs.metrics(tmp_path / "one"), runs.metrics(tmp_path / "split")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1e-4)

    # Step 5 (index 4), under the weights of the checkpoint at step 4: a model that has
    # learnt something, so that windows differ in their mean loss too.
    sums, counts, _ = _window_losses(one, tmp_path / "one", data_root / "uneven", 8, step=4)
    assert counts.min() >= 1 and counts.max() >= 5 * counts.min()  # very different lengths
    per_token = sums.sum() / counts.sum()
    assert a[4]["loss"] == pytest.approx(per_token, rel=1e-5)
    # The old formula: each micro-batch's own mean (here one window each: slot 2m + rank),
    # averaged over the micro-batches and the ranks. It is not the step's per-token mean.
    old = float(np.mean(sums / counts))
    assert abs(old - per_token) > 100 * 1e-5 * per_token
