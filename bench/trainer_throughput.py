"""Throughput of our trainer against the plainest DDP loop, and FSDP against DDP, side by side.

    .venv/bin/python bench/trainer_throughput.py [--rounds 3] [--steps 10] [--warmup 2]

Each round runs, on 2 CPU ranks (torchrun, gloo, one thread a rank), three jobs of the same
GPT, batch, sequence length, AdamW and fp32 for the same number of steps:

- ``ours-ddp``:  ``torchrun -m trainer`` with strategy ddp (eval and periodic checkpoints off)
- ``bare-ddp``:  ``bench/bare_ddp.py``, a hand-written DDP loop with nothing else in it
- ``ours-fsdp``: ``torchrun -m trainer`` with strategy fsdp

Rounds alternate the order (A B C, then C B A, ...), so a linear drift falls on every job
alike. Every figure comes from the unix time stamped at the end of each step (the trainer's
metrics.jsonl ``time``, the bare loop's own list), over the steps after the warm-up ones:

- wall: ``tokens / (t[last] - t[warmup - 1])``, everything included;
- cpu: the same tokens over the CPU seconds the ranks burnt in that window (sampled from
  /proc every 50 ms, interpolated at the stamps), times the rank count: the tokens/s the job
  would make with a core per rank to itself. On a machine that neighbours share, this is the
  figure to compare; the wall figures move with whatever else runs (the share of the CPUs
  other processes used during each run is printed beside it).

Reported per job: the median over rounds; then ours/bare (goal >= 0.97) and fsdp/ddp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._torchrun import Launch, launch, step_rates, step_records, torchrun  # noqa: E402
from trainer.prepare import prepare_demo  # noqa: E402

KINDS = ("ours-ddp", "bare-ddp", "ours-fsdp")


@dataclass
class Result:
    wall: float  # tokens/s over the steady window
    cpu: float  # tokens per rank-CPU-second, times the rank count
    others: float  # share of the machine's CPUs used by other processes during the run
    losses: list[float]
    own: float | None = None  # the trainer's own median tokens_per_s metric


def _config(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "precision": "fp32",
        "steps": args.warmup + args.steps,
        "seed": 1234,
        "model": {
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "d_model": args.d_model,
            "seq_len": args.seq_len,
            "vocab_size": 256,
        },
        "data": {"path": "demo"},
        "batch": {"micro_batch_size": args.micro_batch, "grad_accum_steps": 1},
        "optim": {"lr": 3e-4, "warmup_steps": 2, "grad_clip": 1.0},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
        "log_every": 1,
    }


def _result(
    args: argparse.Namespace, stamps: list[float], run: Launch, losses: list[float]
) -> Result:
    wall, cpu = step_rates(stamps, args.warmup, args.tokens_per_step, run, args.nproc)
    return Result(wall=wall, cpu=cpu, others=run.others, losses=losses)


def run_ours(args: argparse.Namespace, work: Path, strategy: str, n: int) -> Result:
    cfg = work / f"ours-{strategy}-{n}.json"
    cfg.write_text(json.dumps(_config(args, strategy)))
    run_dir = work / f"run-{strategy}-{n}"
    argv = [*torchrun(args.nproc), "-m", "trainer", "--config", str(cfg),
            "--run-dir", str(run_dir), "--data-root", str(work / "data")]  # fmt: skip
    run = launch(argv, work / f"ours-{strategy}-{n}.log", args.timeout, launcher=True)
    records = step_records(run_dir, args.warmup + args.steps)
    stamps = [float(r["time"]) for r in records]
    result = _result(args, stamps, run, [float(r["loss"]) for r in records])
    result.own = statistics.median(float(r["tokens_per_s"]) for r in records[args.warmup :])
    return result


def run_bare(args: argparse.Namespace, work: Path, n: int) -> Result:
    cfg = work / f"bare-{n}.json"
    cfg.write_text(json.dumps(_config(args, "ddp")))
    out = work / f"bare-{n}.out.json"
    argv = [*torchrun(args.nproc), str(REPO / "bench" / "bare_ddp.py"), "--config", str(cfg),
            "--data", str(work / "data" / "demo"), "--out", str(out)]  # fmt: skip
    run = launch(argv, work / f"bare-{n}.log", args.timeout, launcher=True)
    got = json.loads(out.read_text())
    return _result(args, got["time"], run, got["loss"])


def _report(args: argparse.Namespace, results: dict[str, list[Result]], elapsed: float) -> None:
    wall = {k: statistics.median(r.wall for r in v) for k, v in results.items()}
    cpu = {k: statistics.median(r.cpu for r in v) for k, v in results.items()}
    print()
    print(f"GPT n_layer={args.n_layer} d_model={args.d_model} seq_len={args.seq_len} "
          f"micro_batch={args.micro_batch} x {args.nproc} ranks (gloo, fp32, 1 thread/rank); "
          f"{args.steps} timed steps after {args.warmup} warm-up, {args.rounds} rounds, "
          f"{elapsed:.0f} s")  # fmt: skip
    print(f"{'run':<10} {'cpu tok/s':>10} {'cpu, per round':>22} {'wall tok/s':>11} "
          f"{'others used':>12} {'loss first->last':>17}")  # fmt: skip
    for k in KINDS:
        per_round = " ".join(f"{r.cpu:.0f}" for r in results[k])
        others = statistics.mean(r.others for r in results[k])
        lo = results[k][-1].losses
        print(f"{k:<10} {cpu[k]:>10.0f} {per_round:>22} {wall[k]:>11.0f} {others:>12.0%} "
              f"{lo[0]:>8.3f}->{lo[-1]:.3f}")  # fmt: skip
    for k in ("ours-ddp", "ours-fsdp"):
        own = statistics.median(r.own for r in results[k] if r.own is not None)
        print(f"  the trainer's own tokens_per_s metric, {k}: median {own:.0f} (wall)")
    for label, m in (("cpu", cpu), ("wall", wall)):
        ratio = m["ours-ddp"] / m["bare-ddp"]
        verdict = "meets" if ratio >= 0.97 else "BELOW"
        print(f"{label:>4}: ours/bare (DDP) {ratio:.3f}x ({verdict} the 0.97x goal); "
              f"fsdp/ddp (ours) {m['ours-fsdp'] / m['ours-ddp']:.3f}x")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--keep", type=Path, default=None, help="keep run dirs and logs here")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 2 or args.rounds < 1:
        p.error("--warmup and --rounds must be >= 1, --steps >= 2")
    args.tokens_per_step = args.micro_batch * args.seq_len * args.nproc

    with tempfile.TemporaryDirectory(prefix="trainq-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_demo(work / "data" / "demo")
        results: dict[str, list[Result]] = {k: [] for k in KINDS}
        started = time.monotonic()
        for n in range(args.rounds):
            for kind in KINDS if n % 2 == 0 else KINDS[::-1]:
                if kind == "bare-ddp":
                    r = run_bare(args, work, n)
                else:
                    r = run_ours(args, work, kind.split("-")[1], n)
                results[kind].append(r)
                print(f"round {n} {kind:<9} {r.cpu:7.0f} tokens/s cpu, {r.wall:7.0f} wall; "
                      f"other processes used {r.others:4.0%} of the CPUs", flush=True)  # fmt: skip
        _report(args, results, time.monotonic() - started)


if __name__ == "__main__":
    main()
