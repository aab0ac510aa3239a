"""The plainest hand-written DDP loop: the baseline `bench/trainer_throughput.py` compares against.

``torchrun --standalone --nproc-per-node 2 bench/bare_ddp.py --config run.json --data DIR
--out times.json``: the same GPT (``trainer.model``), batch, sequence length, AdamW and fp32
as the trainer, with nanoGPT's ``get_batch`` (random windows of one memory-mapped shard) and
nothing else: no schedule, no metrics, no checkpoints. Rank 0 writes the unix time at the end
of every step, the same stamp the trainer's metrics.jsonl carries, so both are timed alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config import load_config
from trainer.data import find_shards, open_shard
from trainer.model import GPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = load_config(args.config)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    model.init_weights()
    ddp = DDP(model)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    tokens = open_shard(find_shards(Path(args.data), "train")[0])
    B, T = cfg.batch.micro_batch_size, cfg.model.seq_len
    gen = torch.Generator().manual_seed(cfg.seed + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(tokens) - T - 1, (B,), generator=gen).tolist()
        w = torch.from_numpy(np.stack([tokens[i : i + T + 1] for i in ix]).astype(np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    stamps: list[float] = []
    losses: list[float] = []
    for _ in range(cfg.steps):
        x, y = get_batch()
        loss = ddp(x, y)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        stamps.append(time.time())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"time": stamps, "loss": losses, "world": world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
