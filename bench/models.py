"""The model families under our trainer against a bare DDP loop, and activation checkpointing.

    .venv/bin/python bench/models.py [--rounds 3] [--steps 6] [--warmup 2] [--bare-llama]

One Llama size throughout (default: 4 layers, width 128, 4 heads, 2 key/value heads, seq
128, vocab 256, micro batch 8, fp32, AdamW, grad clip 1.0), on the byte-level demo corpus
(``trainer.prepare.prepare_demo``), one thread a process (OMP_NUM_THREADS=1):

1. ``ours-llama``: ``torchrun -m trainer``, family llama, strategy ddp, 2 ranks gloo, against
   ``bare-hf``: transformers' ``LlamaForCausalLM`` of the same size in the plainest DDP loop
   (a script generated into the temp dir: ``init_process_group("gloo")``, ``DDP(model)``,
   AdamW, a few random token batches drawn once and cycled, logits -> fp32 cross entropy as
   the trainer computes it, backward, clip, step). Goal: ours/bare >= 1.0.
2. ``ours-hf``: the trainer, family hf, with the same saved ``LlamaForCausalLM`` folder (the
   bare loop loads it too, so both start from the same weights) against ``bare-hf``.
   Goal: >= 0.97.
   ``--bare-llama`` adds ``bare-llama``: our ``trainer.llama.Llama`` in the same bare loop,
   which splits (1) into implementation (bare-llama/bare-hf) and trainer (ours/bare-llama).
3. ``ac-none`` / ``ac-full``: our llama, one process (``python -m trainer``), activation
   checkpointing none vs full: tokens/s and peak memory. In the first ``--ac-rounds`` rounds
   only (default 2: its differences are large, and every run costs ~10 s of start-up here).

Rounds alternate the order (A B C, then C B A, ...), so a linear drift falls on every job
alike. Every figure comes from the unix time stamped at the end of each step (the trainer's
metrics.jsonl ``time``; the bare loop's own list, stamped after ``loss.item()``) over the
steps after the warm-up ones:

- wall: ``tokens / (t[last] - t[warmup - 1])``, everything in the loop included;
- cpu: the same tokens over the CPU seconds the ranks burnt in that window (sampled from
  /proc every 50 ms, interpolated at the stamps), times the rank count: the tokens/s with a
  core per rank to itself. The machine is shared, so this is the figure to compare; the
  share of the CPUs other processes used during each run is printed beside it.
- own: the trainer's own ``tokens_per_s`` metric (median over the same steps): its per-step
  window, which leaves out logging.

Peak memory: ``ru_maxrss`` of the ``os.wait4`` of each launched process: the kernel's
high-water mark of the resident set (VmHWM at exit) of the largest single process in that
tree (for torchrun, the larger rank). wait4 on the one pid, not RUSAGE_CHILDREN, because
the latter is the maximum over every child this script ever reaped, so each run would
inherit the peaks of the runs before it. For (3) also the trainer's own
``mem_peak_bytes`` of the last step record (on CPU: the rank's own ru_maxrss), which leaves
out the final checkpoint save. Both include Python and torch themselves (a few hundred
MiB); the difference between none and full is the activation memory saved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._torchrun import (  # noqa: E402
    Launch,
    launch,
    run_bare_loop,
    step_rates,
    step_records,
    torchrun,
)
from trainer.prepare import prepare_demo  # noqa: E402

MIB = 1024 * 1024
HF_FOLDER = "hf-llama"  # under the data root

# The plainest DDP loop; ``--impl hf`` trains the saved LlamaForCausalLM folder, ``--impl
# ours`` trainer.llama.Llama of the same size. Rank 0 writes the unix time at the end of
# every step, as the trainer's metrics.jsonl does.
BARE_LOOP = """
import json, sys, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = json.loads(open(sys.argv[1]).read())
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(p["seed"])
if p["impl"] == "hf":
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(p["folder"], torch_dtype=torch.float32)

    def logits_of(x):
        return model_ddp(input_ids=x, use_cache=False).logits
else:
    from trainer.config import LlamaConfig
    from trainer.llama import Llama

    model = Llama(LlamaConfig.model_validate(p["llama"]))
    model.init_weights()

    def logits_of(x):
        return model_ddp(x)
model.train()
model_ddp = DDP(model)
opt = torch.optim.AdamW(
    model.parameters(), lr=p["lr"], betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
)
B, T, V = p["batch"], p["seq"], p["vocab"]
gen = torch.Generator().manual_seed(p["seed"] + rank)
batches = torch.randint(0, V, (8, B, T + 1), generator=gen)
stamps, losses = [], []
for step in range(p["steps"]):
    w = batches[step % len(batches)]
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    logits = logits_of(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    if p["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), p["grad_clip"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
    stamps.append(time.time())
if rank == 0:
    open(p["out"], "w").write(json.dumps({"time": stamps, "loss": losses}))
dist.destroy_process_group()
"""


@dataclass
class Result:
    wall: float  # tokens/s over the steady window
    cpu: float  # tokens per rank-CPU-second, times the rank count
    others: float  # share of the machine's CPUs used by other processes during the run
    peak_rss: int  # bytes: ru_maxrss from wait4, the largest process of the tree
    losses: list[float]
    own: float | None = None  # the trainer's own median tokens_per_s
    mem_metric: int | None = None  # the trainer's mem_peak_bytes at the last step
    extra: dict[str, float] = field(default_factory=dict)


def _llama(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "family": "llama",
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_kv_head": args.n_kv_head,
        "d_model": args.d_model,
        "seq_len": args.seq_len,
        "vocab_size": args.vocab,
    }


def save_hf_folder(args: argparse.Namespace, folder: Path) -> int:
    """A LlamaForCausalLM the size of ``_llama(args)`` saved to ``folder``; its parameters."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from trainer.config import LlamaConfig

    ours = LlamaConfig.model_validate(_llama(args))
    hf_cfg = HFLlamaConfig(
        vocab_size=ours.vocab_size,
        hidden_size=ours.d_model,
        intermediate_size=ours.hidden,
        num_hidden_layers=ours.n_layer,
        num_attention_heads=ours.n_head,
        num_key_value_heads=ours.kv_heads,
        max_position_embeddings=ours.seq_len,
        rms_norm_eps=ours.norm_eps,
        rope_theta=ours.rope_theta,  # type: ignore[call-arg]  # 5.x: into rope_parameters
        tie_word_embeddings=ours.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(hf_cfg)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _config(
    args: argparse.Namespace, model: dict[str, Any], ac: str = "none", **train: Any
) -> dict[str, Any]:
    return {
        **train,
        "strategy": "ddp",
        "precision": "fp32",
        "steps": args.warmup + args.steps,
        "seed": args.seed,
        "model": model,
        "data": {"path": "demo"},
        "batch": {"micro_batch_size": args.micro_batch, "grad_accum_steps": 1},
        "optim": {"lr": 3e-4, "warmup_steps": 2, "grad_clip": args.grad_clip},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
        "log_every": 1,
        "activation_checkpointing": ac,
    }


# --- running and measuring one job -------------------------------------------------------


def _result(
    args: argparse.Namespace, nproc: int, stamps: list[float], run: Launch, losses: list[float]
) -> Result:
    if len(stamps) != args.warmup + args.steps:
        sys.exit(f"got {len(stamps)} step stamps, expected {args.warmup + args.steps}")
    tokens_per_step = args.micro_batch * args.seq_len * nproc
    wall, cpu = step_rates(stamps, args.warmup, tokens_per_step, run, nproc)
    return Result(wall=wall, cpu=cpu, others=run.others, peak_rss=run.peak_rss, losses=losses)


def run_ours(
    args: argparse.Namespace, work: Path, kind: str, n: int, model: dict[str, Any], nproc: int,
    ac: str = "none", **train: Any,
) -> Result:  # fmt: skip
    """``train``: more of the spec's top-level fields (``expert_parallel``, say)."""
    cfg = work / f"{kind}-{n}.json"
    cfg.write_text(json.dumps(_config(args, model, ac, **train)))
    run_dir = work / f"run-{kind}-{n}"
    tail = ["-m", "trainer", "--config", str(cfg), "--run-dir", str(run_dir),
            "--data-root", str(work / "data")]  # fmt: skip
    argv = [*torchrun(nproc), *tail] if nproc > 1 else [sys.executable, *tail]
    run = launch(argv, work / f"{kind}-{n}.log", args.timeout, launcher=nproc > 1)
    records = step_records(run_dir, args.warmup + args.steps)
    stamps = [float(r["time"]) for r in records]
    result = _result(args, nproc, stamps, run, [float(r["loss"]) for r in records])
    steady = records[args.warmup :]
    result.own = statistics.median(float(r["tokens_per_s"]) for r in steady)
    result.mem_metric = int(records[-1]["mem_peak_bytes"])
    result.extra["data_wait"] = statistics.median(float(r["data_wait_frac"]) for r in steady)
    return result


def run_bare(args: argparse.Namespace, work: Path, kind: str, n: int) -> Result:
    params = {
        "impl": "ours" if kind == "bare-llama" else "hf",
        "folder": str(work / "data" / HF_FOLDER),
        "llama": _llama(args),
        "seed": args.seed,
        "lr": 3e-4,
        "grad_clip": args.grad_clip,
        "batch": args.micro_batch,
        "seq": args.seq_len,
        "vocab": args.vocab,
        "steps": args.warmup + args.steps,
    }
    script = work / "bare_loop.py"
    got, run = run_bare_loop(script, params, work, f"{kind}-{n}", args.nproc, args.timeout)
    return _result(args, args.nproc, got["time"], run, got["loss"])


# --- report ------------------------------------------------------------------------------


def _median(results: list[Result], key: str) -> float:
    return statistics.median(float(getattr(r, key)) for r in results)


def _table(results: dict[str, list[Result]]) -> None:
    print(f"{'run':<11} {'cpu tok/s':>9} {'cpu, per round':>20} {'wall tok/s':>10} "
          f"{'own tok/s':>9} {'peak RSS':>9} {'others':>6} {'loss first->last':>16}")  # fmt: skip
    for kind, rs in results.items():
        per_round = " ".join(f"{r.cpu:.0f}" for r in rs)
        own = statistics.median(r.own for r in rs if r.own is not None) if rs[0].own else None
        own_s = f"{own:>9.0f}" if own is not None else f"{'-':>9}"
        peak = max(r.peak_rss for r in rs) / MIB
        others = statistics.mean(r.others for r in rs)
        lo = rs[-1].losses
        print(f"{kind:<11} {_median(rs, 'cpu'):>9.0f} {per_round:>20} {_median(rs, 'wall'):>10.0f} "
              f"{own_s} {peak:>5.0f} MiB {others:>6.0%} {lo[0]:>7.3f}->{lo[-1]:.3f}")  # fmt: skip


def _report(
    args: argparse.Namespace,
    fam: dict[str, list[Result]],
    ac: dict[str, list[Result]],
    n_params: int,
    elapsed: float,
) -> None:
    print()
    print(f"Llama n_layer={args.n_layer} d_model={args.d_model} heads={args.n_head}/"
          f"{args.n_kv_head}kv seq_len={args.seq_len} vocab={args.vocab} ({n_params:,} "
          f"parameters, both implementations) micro_batch={args.micro_batch}, fp32, "
          f"grad_clip={args.grad_clip}, 1 thread/process; {args.steps} timed steps after "
          f"{args.warmup} warm-up, {args.rounds} rounds "
          f"({min(args.ac_rounds, args.rounds)} with (3)), {elapsed:.0f} s")  # fmt: skip
    print(f"families, {args.nproc} ranks gloo (DDP):")
    _table(fam)
    for kind in ("ours-llama", "ours-hf"):
        dw = statistics.median(r.extra["data_wait"] for r in fam[kind])
        print(f"  {kind}: data_wait_frac median {dw:.1%}")
    if ac["ac-none"]:
        print("activation checkpointing, our llama, 1 process (peak RSS: wait4 ru_maxrss):")
        _table(ac)
    for kind, rs in ac.items() if ac["ac-none"] else ():
        print(f"  {kind}: the trainer's mem_peak_bytes at the last step: "
              f"{statistics.median(r.mem_metric or 0 for r in rs) / MIB:.0f} MiB")  # fmt: skip

    print("\nsummary (medians over rounds; cpu = per core-second, the figure to compare here):")
    bare = fam["bare-hf"]
    for i, (kind, goal) in enumerate((("ours-llama", 1.0), ("ours-hf", 0.97)), 1):
        parts = []
        for m in ("cpu", "wall"):
            ratio = _median(fam[kind], m) / _median(bare, m)
            parts.append(f"{m} {ratio:.3f}x ({'meets' if ratio >= goal else 'BELOW'})")
        print(f"{i}. {kind}/bare-hf: {', '.join(parts)}  [goal >= {goal}]")
    if "bare-llama" in fam:
        bl, ol = fam["bare-llama"], fam["ours-llama"]
        print(f"   split of 1: implementation bare-llama/bare-hf "
              f"cpu {_median(bl, 'cpu') / _median(bare, 'cpu'):.3f}x; trainer ours-llama/"
              f"bare-llama cpu {_median(ol, 'cpu') / _median(bl, 'cpu'):.3f}x, "
              f"wall {_median(ol, 'wall') / _median(bl, 'wall'):.3f}x")  # fmt: skip
    none, full = ac["ac-none"], ac["ac-full"]
    if not none:
        print("3. skipped (--ac-rounds 0)")
        return
    rss_none = statistics.median(r.peak_rss for r in none) / MIB
    rss_full = statistics.median(r.peak_rss for r in full) / MIB
    met_none = statistics.median(r.mem_metric or 0 for r in none) / MIB
    met_full = statistics.median(r.mem_metric or 0 for r in full) / MIB
    print(f"3. ac full/none: tokens/s cpu {_median(full, 'cpu') / _median(none, 'cpu'):.3f}x, "
          f"wall {_median(full, 'wall') / _median(none, 'wall'):.3f}x; peak RSS "
          f"{rss_none:.0f} -> {rss_full:.0f} MiB ({rss_full - rss_none:+.0f} MiB), "
          f"trainer's mem_peak_bytes {met_none:.0f} -> {met_full:.0f} MiB "
          f"({met_full - met_none:+.0f} MiB)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--nproc", type=int, default=2, help="ranks for the family runs")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-clip", type=float, default=1.0, help="both sides; 0: off")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bare-llama", action="store_true", help="also our Llama in the bare loop")
    p.add_argument(
        "--ac-rounds", type=int, default=2, help="rounds that also run (3); 0: leave it out"
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--keep", type=Path, default=None, help="keep run dirs and logs here")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 2 or args.rounds < 1:
        p.error("--warmup and --rounds must be >= 1, --steps >= 2")
    if args.vocab > 256:
        p.error("--vocab: the demo corpus is bytes; at most 256")

    with tempfile.TemporaryDirectory(prefix="trainq-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_demo(work / "data" / "demo")
        n_params = save_hf_folder(args, work / "data" / HF_FOLDER)
        (work / "bare_loop.py").write_text(BARE_LOOP)
        hf_model = {"family": "hf", "path": HF_FOLDER, "seq_len": args.seq_len}

        kinds = ["ours-llama", "ours-hf", "bare-hf"]
        kinds += ["bare-llama"] if args.bare_llama else []
        fam: dict[str, list[Result]] = {k: [] for k in kinds}
        ac: dict[str, list[Result]] = {"ac-none": [], "ac-full": []}
        started = time.monotonic()
        for n in range(args.rounds):
            jobs = [*kinds, *(ac if n < args.ac_rounds else [])]
            for kind in jobs if n % 2 == 0 else jobs[::-1]:
                if kind == "ours-llama":
                    r = run_ours(args, work, kind, n, _llama(args), args.nproc)
                elif kind == "ours-hf":
                    r = run_ours(args, work, kind, n, hf_model, args.nproc)
                elif kind.startswith("bare-"):
                    r = run_bare(args, work, kind, n)
                else:
                    r = run_ours(args, work, kind, n, _llama(args), 1, kind.split("-")[1])
                (ac if kind.startswith("ac-") else fam)[kind].append(r)
                print(f"round {n} {kind:<10} {r.cpu:7.0f} tokens/s cpu, {r.wall:7.0f} wall, "
                      f"peak RSS {r.peak_rss / MIB:4.0f} MiB; other processes used "
                      f"{r.others:4.0%} of the CPUs", flush=True)  # fmt: skip
        _report(args, fam, ac, n_params, time.monotonic() - started)


if __name__ == "__main__":
    main()
