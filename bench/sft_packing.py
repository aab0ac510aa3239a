"""Packed vs unpacked SFT training on mixed-length conversations (issue 24).

A chat dataset of seeded conversations (byte tokens, lengths spread so the median is under a
quarter of ``seq_len``) is prepared with ``trainer.prepare.prepare_sft``; one small Llama
then trains (forward, backward, AdamW step; ``trainer.train.token_loss_sum``) on:

- ``packed``: ``data.packing`` rows (whole examples best-fit into ``seq_len``, document ids,
  block-diagonal attention);
- ``unpacked, pad to seq_len``: one example a row, padded to ``seq_len``;
- ``unpacked, pad to longest``: one example a row, padded to the batch's longest (TRL's
  default collator).

Each side gets the same number of rows a step; measured alternately (A B C, C B A ...).
The figure is examples' tokens (predictions) per second: padding does not count. Goal:
packed >= 2x unpacked when the median example is under ``seq_len / 4``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trainer.config import LlamaConfig, OptimConfig
from trainer.data import IGNORE_INDEX, BatchSampler, TokenDataset
from trainer.models import build_model
from trainer.prepare import prepare_sft
from trainer.train import build_optimizer, token_loss_sum

WORDS = (
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"),
    *("and", "cat", "runs", "far", "away", "home"),
)


def conversations(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        turns = int(rng.choice([1, 1, 1, 2]))
        messages = []
        for _ in range(turns):
            q = int(np.clip(rng.lognormal(0.9, 0.9), 1, 80))
            a = int(np.clip(rng.lognormal(0.7, 0.9), 1, 80))
            messages += [
                {"role": "user", "content": " ".join(rng.choice(WORDS, q))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS, a))},
            ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")


def unpacked_rows(ds: TokenDataset) -> list[tuple[np.ndarray, np.ndarray]]:
    """One example a row (``ds``'s examples: inputs and targets), shuffled once."""
    rows = []
    for k, a, n, _ in ds._seg.T.tolist():
        tokens = np.asarray(ds.shards[k][a : a + n], dtype=np.int64)
        mask = np.asarray(ds.masks[k][a + 1 : a + n]) if ds.masks is not None else None
        y = tokens[1:] if mask is None else np.where(mask != 0, tokens[1:], IGNORE_INDEX)
        rows.append((tokens[:-1], y))
    order = np.random.default_rng(0).permutation(len(rows))
    return [rows[i] for i in order]


def collate(rows: list[tuple[np.ndarray, np.ndarray]], T: int) -> tuple[torch.Tensor, ...]:
    x = torch.zeros(len(rows), T, dtype=torch.int64)
    y = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.int64)
    for r, (xi, yi) in enumerate(rows):
        x[r, : xi.size] = torch.from_numpy(xi)
        y[r, : yi.size] = torch.from_numpy(yi)
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps per side and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--examples", type=int, default=500)
    args = p.parse_args()
    T, B = args.seq_len, args.batch
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "chats.jsonl"
        conversations(src, args.examples, seed=0)
        prepare_sft([src], Path(tmp) / "d", "chat", val_fraction=0.0)
        ds = TokenDataset(Path(tmp) / "d", "train", T, packing=True)
    lengths = ds._seg[2]
    print(
        f"{ds.examples} examples: median {int(np.median(lengths))} tokens, seq_len {T} "
        f"(median/seq_len {np.median(lengths) / T:.3f}); packed into {ds.num_samples} rows, "
        f"efficiency {100 * ds.efficiency:.1f}%"
    )
    cfg = LlamaConfig(family="llama", n_layer=4, n_head=4, d_model=128, seq_len=T, vocab_size=256)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights()
    model.train()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    sampler = BatchSampler(ds, B, 1, 0, 1, seed=0)
    single = unpacked_rows(ds)

    def packed(i: int) -> tuple[tuple[torch.Tensor, ...], int]:
        rows = sampler.indices(i, 0)
        first, last = ds._row_first[rows], ds._row_first[rows + 1]
        real = sum(int((ds._seg[2, a:b] - 1).sum()) for a, b in zip(first, last, strict=True))
        return sampler.batch(i, 0), real

    def unpacked(i: int, longest: bool) -> tuple[tuple[torch.Tensor, ...], int]:
        rows = [single[(i * B + j) % len(single)] for j in range(B)]
        width = max(r[0].size for r in rows) if longest else T
        return collate(rows, width), sum(r[0].size for r in rows)

    sides = {
        "packed": packed,
        "unpacked, pad to seq_len": lambda i: unpacked(i, False),
        "unpacked, pad to longest": lambda i: unpacked(i, True),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    step = 0
    for rnd in range(args.rounds):
        for name in list(sides) if rnd % 2 == 0 else list(reversed(sides)):
            batches = [sides[name](step + i) for i in range(args.steps + 1)]
            step += args.steps + 1
            tokens, seconds = 0, 0.0
            for n, (batch, real) in enumerate(batches):
                t0 = time.perf_counter()
                targets = max(1, int((batch[1] != IGNORE_INDEX).sum()))
                (token_loss_sum(model, *batch) / targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if n:  # the first is a warm-up
                    seconds += time.perf_counter() - t0
                    tokens += real
            rates[name].append(tokens / seconds)
    base = statistics.median(rates["packed"])
    print(f"{'side':28} {'example tokens/s':>18} {'packed / side':>14}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:28} {rate:18,.0f} {base / rate:14.2f}x")


if __name__ == "__main__":
    main()
