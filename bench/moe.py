"""The moe family against transformers' Mixtral, against a dense llama of the same active
parameters, and its grouped experts against the expert loop.

    .venv/bin/python bench/moe.py [--rounds 2] [--steps 6] [--warmup 2]

One size throughout (default: 4 layers, width 128, 4 heads, 2 key/value heads, 8 experts of
hidden 256, top 2, seq 128, vocab 256, micro batch 8, fp32, AdamW, grad clip 1.0), on the
byte-level demo corpus, one thread a process, as bench/models.py measures (its launcher,
stamps, CPU sampling and table):

1. ``ours-moe``: ``torchrun -m trainer``, family moe, DDP on 2 gloo ranks (its load-balancing
   loss, coefficient 0.02, in the objective) against ``bare-mixtral``: transformers'
   ``MixtralForCausalLM`` of the same shape in the plainest DDP loop (``DDP(model)``,
   AdamW, random token batches cycled, fp32 cross entropy plus 0.02 times the
   ``aux_loss`` that ``output_router_logits=True`` computes, backward, clip, step).
   Goal: ours/bare >= 1.0.
2. ``ours-dense``: our llama with ``ffn_hidden = top_k * expert hidden``, the moe's active
   parameters (but the router's), under the same trainer: what the sparsity costs per token.
   Printed, no goal.
4. ``ours-moe-ep``: ``ours-moe`` with ``expert_parallel`` = the ranks: each rank holds
   its share of the experts and exchanges the token rows with all-to-alls (gloo) instead
   of holding them all; against ``ours-moe`` (DDP), printed, no goal: on one machine's
   CPU it trades the experts' DDP gradient all-reduce for two all-to-alls per layer each way.
3. grouped vs loop: one moe feed-forward layer (the default shape, 8 x 128 = 1024 tokens a
   forward), forward + backward in this process, ``trainer.moe``'s sorted grouped matmul
   against its transformers-style per-expert ``torch.where`` loop, alternated; median ms.

Rounds alternate the order (A B C, then C B A). cpu = tokens per rank-CPU-second times the
ranks, the figure to compare on a shared machine; wall beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._torchrun import run_bare_loop  # noqa: E402
from bench.models import Result, _median, _result, _table, run_ours  # noqa: E402
from trainer.prepare import prepare_demo  # noqa: E402

AUX = 0.02

BARE_LOOP = """
import json, sys, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MixtralForCausalLM

p = json.loads(open(sys.argv[1]).read())
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(p["seed"])
model = MixtralForCausalLM.from_pretrained(p["folder"], dtype=torch.float32)
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
    out = model_ddp(input_ids=x, use_cache=False, output_router_logits=True)
    logits = out.logits
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    loss = loss + p["aux"] * out.aux_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), p["grad_clip"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
    stamps.append(time.time())
if rank == 0:
    open(p["out"], "w").write(json.dumps({"time": stamps, "loss": losses}))
dist.destroy_process_group()
"""


def _moe(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "family": "moe",
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_kv_head": args.n_kv_head,
        "d_model": args.d_model,
        "ffn_hidden": args.expert_hidden,
        "seq_len": args.seq_len,
        "vocab_size": args.vocab,
        "n_experts": args.n_experts,
        "top_k": args.top_k,
        "aux_loss_coef": AUX,
    }


def _dense(args: argparse.Namespace) -> dict[str, Any]:
    fields = _moe(args)
    for key in ("n_experts", "top_k", "aux_loss_coef"):
        fields.pop(key)
    return {**fields, "family": "llama", "ffn_hidden": args.top_k * args.expert_hidden}


def save_mixtral(args: argparse.Namespace, folder: Path) -> tuple[int, int, int]:
    """A MixtralForCausalLM of ``_moe(args)``'s shape saved to ``folder``; (its parameters,
    our moe's total and active, our dense llama's)."""
    import torch
    from transformers import MixtralForCausalLM

    from trainer.config import LlamaConfig, MoeConfig
    from trainer.hf_io import hf_config
    from trainer.llama import Llama
    from trainer.moe import MoE

    ours = MoeConfig.model_validate(_moe(args))
    fields = hf_config(ours)
    fields.pop("model_type")
    from transformers import MixtralConfig

    torch.manual_seed(args.seed)
    model = MixtralForCausalLM(MixtralConfig(**fields))
    model.save_pretrained(folder)
    with torch.device("meta"):
        moe = MoE(ours)
        dense = Llama(LlamaConfig.model_validate(_dense(args)))
    total = sum(p.numel() for p in model.parameters())
    return total, moe.active_params(), dense.num_params()


def run_bare(args: argparse.Namespace, work: Path, n: int) -> Result:
    params = {
        "folder": str(work / "mixtral"),
        "seed": args.seed,
        "lr": 3e-4,
        "aux": AUX,
        "grad_clip": args.grad_clip,
        "batch": args.micro_batch,
        "seq": args.seq_len,
        "vocab": args.vocab,
        "steps": args.warmup + args.steps,
    }
    script = work / "bare_loop.py"
    got, run = run_bare_loop(script, params, work, f"bare-{n}", args.nproc, args.timeout)
    return _result(args, args.nproc, got["time"], run, got["loss"])


def grouped_vs_loop(args: argparse.Namespace, reps: int) -> tuple[float, float, float]:
    """Median ms of one layer's forward + backward, grouped and loop, and their max diff."""
    import torch

    from trainer.config import MoeConfig
    from trainer.moe import MoE

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = MoE(MoeConfig.model_validate(_moe(args)))
    model.init_weights()
    layer: Any = model.blocks[0].feed_forward
    x = torch.randn(args.micro_batch, args.seq_len, args.d_model, requires_grad=True)
    grad = torch.randn_like(x)
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {}
    for i in range(reps):
        for grouped in (True, False) if i % 2 == 0 else (False, True):
            layer.grouped = grouped
            t0 = time.perf_counter()
            y = layer(x)
            y.backward(grad)
            times[grouped].append(time.perf_counter() - t0)
            outs[grouped] = y.detach()
            x.grad = None
    diff = float((outs[True] - outs[False]).abs().max())
    g, lo = (statistics.median(times[k][1:]) * 1e3 for k in (True, False))
    return g, lo, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layer-reps", type=int, default=21, help="(3)'s alternated repetitions")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--keep", type=Path, default=None, help="keep run dirs and logs here")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 2 or args.rounds < 1:
        p.error("--warmup and --rounds must be >= 1, --steps >= 2")

    with tempfile.TemporaryDirectory(prefix="trainq-bench-moe-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_demo(work / "data" / "demo")
        total, active, dense = save_mixtral(args, work / "mixtral")
        (work / "bare_loop.py").write_text(BARE_LOOP)
        kinds = ["ours-moe", "ours-moe-ep", "bare-mixtral", "ours-dense"]
        results: dict[str, list[Result]] = {k: [] for k in kinds}
        started = time.monotonic()
        for n in range(args.rounds):
            for kind in kinds if n % 2 == 0 else kinds[::-1]:
                if kind == "bare-mixtral":
                    r = run_bare(args, work, n)
                elif kind == "ours-dense":
                    r = run_ours(args, work, kind, n, _dense(args), args.nproc)
                else:  # ours-moe-ep: the experts split over the ranks
                    ep = {"expert_parallel": args.nproc} if kind == "ours-moe-ep" else {}
                    r = run_ours(args, work, kind, n, _moe(args), args.nproc, **ep)
                results[kind].append(r)
                print(f"round {n} {kind:<12} {r.cpu:7.0f} tokens/s cpu, {r.wall:7.0f} wall; "
                      f"other processes used {r.others:4.0%} of the CPUs", flush=True)  # fmt: skip
        elapsed = time.monotonic() - started
        g, lo, diff = grouped_vs_loop(args, args.layer_reps)

    print()
    print(f"moe n_layer={args.n_layer} d_model={args.d_model} heads={args.n_head}/"
          f"{args.n_kv_head}kv experts={args.n_experts}x{args.expert_hidden} top_k={args.top_k} "
          f"seq_len={args.seq_len} micro_batch={args.micro_batch}: {total:,} parameters, "
          f"{active:,} active; dense llama ffn_hidden={args.top_k * args.expert_hidden}: "
          f"{dense:,}; fp32, {args.nproc} ranks gloo DDP, 1 thread/process, {args.steps} "
          f"timed steps after {args.warmup}, {args.rounds} rounds, {elapsed:.0f} s")  # fmt: skip
    _table(results)
    print("\nsummary (medians over rounds; cpu = per core-second, the figure to compare here):")
    bare, ours = results["bare-mixtral"], results["ours-moe"]
    for m in ("cpu", "wall"):
        ratio = _median(ours, m) / _median(bare, m)
        print(f"1. ours-moe/bare-mixtral {m}: {ratio:.3f}x "
              f"({'meets' if ratio >= 1.0 else 'BELOW'} goal >= 1.0)")  # fmt: skip
    for m in ("cpu", "wall"):
        ratio = _median(ours, m) / _median(results["ours-dense"], m)
        print(f"2. ours-moe/ours-dense (same active parameters) {m}: {ratio:.3f}x")
    print(f"3. one moe layer fwd+bwd, {args.micro_batch * args.seq_len} tokens: grouped "
          f"{g:.2f} ms, loop {lo:.2f} ms: grouped/loop speed {lo / g:.2f}x "
          f"(outputs differ by {diff:.1e})")  # fmt: skip
    ep = results["ours-moe-ep"]
    for m in ("cpu", "wall"):
        print(f"4. ours-moe-ep/ours-moe (expert parallel over {args.nproc} ranks vs DDP) {m}:"
              f" {_median(ep, m) / _median(ours, m):.3f}x")  # fmt: skip
    lost = max(abs(a - b) for a, b in zip(ep[0].losses, ours[0].losses, strict=True))
    print(f"   ep and ddp losses differ by at most {lost:.1e} (round 0)")


if __name__ == "__main__":
    main()
