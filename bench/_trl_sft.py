"""TRL's side of bench/sft_trl.py: a plain TRL ``SFTTrainer`` script (what a TRL user runs
with ``torchrun --nproc-per-node N``), CPU, fp32, packed rows with assistant-only loss. Rank
0 writes the unix time at the end of each optimizer step, and the tokens seen, to ``--stamps``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--tokenizer", "--data", "--out", "--stamps"):
        p.add_argument(name, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            stamps.append(time.time())

    chats = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line]
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=args.steps,
        assistant_only_loss=True, packing=True, max_length=args.seq_len, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=0, logging_steps=1000,
        learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=1.0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0, include_num_input_tokens_seen="all",
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(chats), callbacks=[Stamp()],
    )  # fmt: skip
    trainer.train()
    if trainer.args.process_index == 0:
        seen = int(trainer.state.num_input_tokens_seen)  # all ranks' tokens, padding included
        Path(args.stamps).write_text(json.dumps({"stamps": stamps, "tokens": seen}))


if __name__ == "__main__":
    main()
