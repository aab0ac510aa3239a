"""trainq's SFT step against TRL's ``SFTTrainer`` on the same tiny model and data (issue 24).

A Qwen2-shaped model built from a config (2 layers, width 64), a byte-level BPE tokenizer
trained here with a chat template marking the answers (``{% generation %}``), seeded
mixed-length conversations (``bench/sft_packing.py``'s). Both sides train the full model in
fp32 on the CPU, packed rows of ``--seq-len`` tokens with the loss on the answers only, the
same rows a step per rank, AdamW, clipping at 1.0:

- trainq: ``python -m trainer`` (one process) or ``torchrun --nproc-per-node 2 -m trainer``
  on the dataset ``prepare_sft`` made (``data.packing``, family ``hf``);
- TRL: ``bench/_trl_sft.py``, a plain ``SFTTrainer`` script (``packing=True``,
  ``assistant_only_loss=True``), run as a TRL user runs it: ``python`` for one process,
  ``torchrun --nproc-per-node 2`` for two (its DDP, gloo).

Each side's step time is measured from the unix time each writes at the end of a step (the
first ``--warmup`` steps left out), wall and per CPU (the ranks' CPU seconds a step: on a
shared 2-core machine, the figure to compare). Runs alternate (trainq, TRL, TRL, trainq ...)
and the ratio printed is TRL's step time over trainq's: >= 1.0 means trainq is as fast or
faster (goal >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench._torchrun import launch, torchrun
from bench.sft_packing import WORDS, conversations
from tests.tiny_hf import qwen2_model, qwen2_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
)


def build(root: Path, seq_len: int) -> None:
    """root/tok (tokenizer.json, tokenizer_config.json) and root/qwen (the model)."""
    lines = [" ".join([*WORDS, "user", "assistant", "system"])] * 50
    vocab = qwen2_tokenizer(root / "tok", lines, TEMPLATE, vocab_size=320,
                            pad_token="<|endoftext|>")  # fmt: skip
    qwen2_model(root / "qwen", vocab, width=64, max_positions=seq_len)


def step_times(stamps: list[float], samples: list[tuple[float, float]], warmup: int
               ) -> tuple[float, float]:  # fmt: skip
    """(wall, CPU) seconds a step after the ``warmup`` first, from the end-of-step stamps."""
    import numpy as np

    start, end = stamps[warmup - 1], stamps[-1]
    n = len(stamps) - warmup
    t = np.array([s[0] for s in samples])
    c = np.maximum.accumulate(np.array([s[1] for s in samples]))
    cpu = float(np.interp(end, t, c) - np.interp(start, t, c))
    return (end - start) / n, cpu / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="packed rows a step per rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternations of each pair")
    p.add_argument("--procs", default="1,2")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-sft-trl-"))
    root = work / "root"
    build(root, args.seq_len)
    chats = work / "chats.jsonl"
    conversations(chats, args.examples, seed=3)
    from trainer.prepare import prepare_sft

    prepare_sft([chats], root / "chat", "chat", tokenizer=root / "tok" / "tokenizer.json",
                val_fraction=0.0)  # fmt: skip
    print(f"# {args.examples} conversations, Qwen2 2x64 (vocab 320ish), seq_len {args.seq_len},"
          f" {args.batch} packed rows a step per rank, {args.steps} steps ({args.warmup} warmup),"
          f" fp32 CPU; a 2-core machine shared with other work", flush=True)  # fmt: skip

    def trainq_run(n: int, tag: str) -> tuple[float, float]:
        cfg = {
            "strategy": "ddp", "precision": "fp32", "steps": args.steps, "seed": 0,
            "model": {"family": "hf", "path": "qwen", "seq_len": args.seq_len},
            "data": {"path": "chat", "packing": True},
            "batch": {"micro_batch_size": args.batch, "grad_accum_steps": 1},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0},
            "eval": {"every": 0}, "checkpoint": {"every": 0, "hf": "none"}, "log_every": 1,
        }  # fmt: skip
        run_dir = work / f"trainq-{tag}"
        run_dir.mkdir()
        (run_dir / "config.json").write_text(json.dumps(cfg))
        tail = ["-m", "trainer", "--config", str(run_dir / "config.json"),
                "--run-dir", str(run_dir), "--data-root", str(root)]  # fmt: skip
        argv = [*torchrun(n), *tail] if n > 1 else [sys.executable, *tail]
        run = launch(argv, run_dir / "log.txt", 900, launcher=n > 1)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        stamps = [r["time"] for r in map(json.loads, lines) if "loss" in r]
        return step_times(stamps, run.samples, args.warmup)

    def trl_run(n: int, tag: str) -> tuple[float, float]:
        out = work / f"trl-{tag}"
        out.mkdir()
        script = str(Path(__file__).with_name("_trl_sft.py"))
        tail = [script, "--model", str(root / "qwen"), "--tokenizer", str(root / "tok"),
                "--data", str(chats), "--out", str(out), "--stamps", str(out / "stamps.json"),
                "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                "--steps", str(args.steps)]  # fmt: skip
        argv = [*torchrun(n), *tail] if n > 1 else [sys.executable, *tail]
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = launch(argv, out / "log.txt", 900, launcher=n > 1, extra_env=env)
        found = json.loads((out / "stamps.json").read_text())
        tokens[f"trl {n}"] = found["tokens"] // len(found["stamps"])
        return step_times(found["stamps"], run.samples, args.warmup)

    tokens: dict[str, int] = {}
    for n in (int(x) for x in args.procs.split(",")):
        ours: list[tuple[float, float]] = []
        theirs: list[tuple[float, float]] = []
        for r in range(args.rounds):
            pair = [("trainq", trainq_run), ("trl", trl_run)]
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                got = fn(n, f"{n}-{r}")
                (ours if name == "trainq" else theirs).append(got)
                print(f"  {n} proc(s) round {r} {name:6s}: {got[0] * 1000:7.1f} ms/step wall,"
                      f" {got[1] * 1000:7.1f} ms CPU/step", flush=True)  # fmt: skip
        wall = statistics.median(t[0] for t in theirs) / statistics.median(o[0] for o in ours)
        cpu = statistics.median(t[1] for t in theirs) / statistics.median(o[1] for o in ours)
        ours_tokens = n * args.batch * args.seq_len
        print(f"  tokens a step (all ranks, padding included): trainq {ours_tokens},"
              f" TRL {tokens[f'trl {n}']}")  # fmt: skip
        print(f"{n} proc(s): TRL/trainq step time {wall:.2f}x wall, {cpu:.2f}x per CPU"
              f" (goal >= 1.0)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
