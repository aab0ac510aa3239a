"""trainer.plan's memory estimate against the measured peak of real training steps on CPU.

    .venv/bin/python bench/plan_memory.py [--steps 3] [--only NAME ...]

Each config runs in fresh subprocesses, twice: once measured by the allocator, once by the
kernel. Both run what ``trainer.train`` runs for a step under the service (torchrun, so a
gloo process group even for one rank): the model drawn from the seed (``trainer.models``,
LoRA's adapters as ``trainer.train._adapted`` adds them), activation checkpointing
(``trainer.parallelize.apply_ac``), then DDP (its gradient buckets included) or FSDP2 (built
on meta, sharded, filled from rank 0's seeded copy); ``build_optimizer`` (AdamW), the
micro-steps under autocast, ``clip_grad_norm``, ``step``, ``zero_grad(set_to_none=True)``;
``--steps`` steps, so the steady state (AdamW's moments there when the activations peak) is
inside the window. DDP runs one rank; FSDP two (one core each; FSDP2 on one rank aliases its
shards and gathers nothing), and rank 0 is measured.

- alloc: torch.profiler with ``profile_memory=True`` sees every allocation and free of
  torch's CPU allocator, each with the allocator's running total of live bytes; counted from
  the start of the window (model not yet built; imports, the batch and the process group
  before it), its maximum is the peak. This is the quantity the plan estimates, the CPU
  counterpart of ``torch.cuda.max_memory_allocated``, and the figure the error is taken on.
  A free made on a thread the profiler does not follow (gloo's, releasing an old DDP
  bucket) is missed and the total then counts that tensor until the end: such a run ends
  with the total above zero, and is run again (``measure``).
- rss: the kernel's high-water mark of resident memory (VmHWM, reset through
  ``/proc/self/clear_refs`` at the start of the window) less the resident memory then. With
  glibc's mmap threshold pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) every tensor bigger
  than that is its own mapping, unmapped when freed, so resident memory follows live tensors
  instead of a heap that never shrinks; MKL's buffer cache is off (``MKL_DISABLE_FAST_MM``).
  What it adds to alloc (small tensors, library workspaces, thread stacks, page granularity)
  is what a device adds too (context, workspaces), so it is printed beside, not used.

Also printed per config: the parameter count of the plan against the built model's, and the
split of the measured peak into what stays between steps (the live bytes when the last step
starts: weights, AdamW's moments, DDP's buckets) and what the step adds, against the same
split of the plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GPT = {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 256, "vocab_size": 8192}
LLAMA = {"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 256}
LLAMA |= {"seq_len": 256, "vocab_size": 8192}
BATCH = {"micro_batch_size": 8, "grad_accum_steps": 1}

# name -> the train spec (fp32 unless named)
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-ac-none": {"model": GPT, "activation_checkpointing": "none"},
    "gpt-ac-full": {"model": GPT, "activation_checkpointing": "full"},
    "llama-ac-none": {"model": LLAMA, "activation_checkpointing": "none"},
    "llama-ac-full": {"model": LLAMA, "activation_checkpointing": "full"},
    "gpt-ac-selective": {"model": GPT, "activation_checkpointing": "selective"},
    "gpt-bf16-ac-none": {"model": GPT, "precision": "bf16"},
    "llama-bf16-ac-none": {"model": LLAMA, "precision": "bf16"},
    "gpt-lora-ac-none": {"model": GPT, "lora": {"rank": 8}},
    "gpt-accum2-ac-none": {"model": GPT, "batch": {"micro_batch_size": 4, "grad_accum_steps": 2}},
    # FSDP on one rank gathers nothing (FSDP2 aliases the shards): two ranks, rank 0 measured
    "gpt-fsdp2-ac-none": {"model": GPT, "strategy": "fsdp", "ranks": 2},
    "llama-fsdp2-ac-full": {
        "model": LLAMA,
        "strategy": "fsdp",
        "activation_checkpointing": "full",
        "ranks": 2,
    },
    "gpt-fsdp2-keep-ac-none": {
        "model": GPT,
        "strategy": "fsdp",
        "fsdp": {"reshard_after_forward": False},
        "ranks": 2,
    },
}


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(spec: dict[str, Any], how: str, steps: int, store: str, rank: int = 0) -> dict[str, Any]:
    """One config, measured one way (``alloc`` or ``rss``), in this (fresh) process: one
    rank of ``spec``'s ``ranks``."""
    import torch
    import torch.distributed as dist

    from trainer.config import HFModelConfig
    from trainer.parallelize import clip_grad_norm, maybe_no_sync
    from trainer.train import build_optimizer

    cfg = _config(spec)
    assert not isinstance(cfg.model, HFModelConfig)
    torch.set_num_threads(2)
    B, T, accum = cfg.batch.micro_batch_size, cfg.model.seq_len, cfg.batch.grad_accum_steps
    gen = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(cfg.model.vocab_size, (B, T), generator=gen) for _ in "xy")
        for _ in range(accum)
    ]
    world = spec.get("ranks", 1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)

    def run() -> int:
        gpt, model, n_params = _build(cfg)
        optimizer = build_optimizer(gpt, cfg.optim)
        for step in range(steps):
            with torch.profiler.record_function(f"step{step}"):
                for i, (x, y) in enumerate(batches):
                    with maybe_no_sync(model, sync=i == accum - 1):
                        with torch.autocast("cpu", dtype=half, enabled=half is not None):
                            loss = model(x, y) / accum
                        loss.backward()
                clip_grad_norm(model, cfg.optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return n_params

    out: dict[str, Any] = {}
    if how == "rss":
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        out["params"] = run()
        out["peak"] = _status("VmHWM") - base
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out["params"] = run()
            gc.collect()  # the window's reference cycles too, before it closes
        out.update(_alloc_figures(prof, steps))
    dist.destroy_process_group()
    return out


def _build(cfg: Any) -> tuple[Any, Any, int]:
    """The model as trainer.train builds it for one rank under torchrun: (the model, what
    runs the steps, the parameter count). ddp: drawn from the seed, DDP-wrapped; fsdp: built
    on meta, sharded, then its shards filled from a seeded copy (freed before the steps)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.lora import apply_lora, init_lora, targets_for
    from trainer.models import build_model
    from trainer.parallelize import apply_ac, apply_fsdp, materialize_fsdp

    def adapted(model: Any) -> Any:  # as trainer.train._adapted
        if cfg.lora is not None:
            apply_lora(model, cfg.lora, targets_for(cfg.model, cfg.lora))
            init_lora(model)
        return model

    def seeded() -> Any:
        torch.manual_seed(cfg.seed)
        model: Any = build_model(cfg.model)
        model.init_weights()
        return adapted(model)

    if cfg.strategy != "fsdp":
        gpt = seeded()
        apply_ac(gpt, cfg.activation_checkpointing)
        return gpt, DDP(gpt), sum(p.numel() for p in gpt.parameters())
    with torch.device("meta"):
        gpt = adapted(build_model(cfg.model))
    apply_ac(gpt, cfg.activation_checkpointing)
    apply_fsdp(
        gpt,
        param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
    )
    full = seeded() if dist.get_rank() == 0 else None  # rank 0 draws, the shards are sent
    materialize_fsdp(gpt, torch.device("cpu"), full)
    del full
    return gpt, gpt, sum(p.numel() for p in gpt.parameters())  # a DTensor's is the whole


def _alloc_figures(prof: Any, steps: int) -> dict[str, int]:
    """The peak of the live tensor bytes over the window, and the live bytes when the last
    step started (what stays between steps).

    Every allocation event carries the CPU allocator's running total over all threads
    (``total_allocated``, c10's ProfiledCPUMemoryReporter), which is what is read: summing
    the events' sizes instead misses a free made on a thread the profiler does not follow
    (gloo's, under DDP) and would count that tensor as live for the rest of the window."""
    from torch._C._profiler import _EventType

    def walk(nodes: Any) -> Any:
        for node in nodes:
            yield node
            yield from walk(node.children)

    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    last = min(n.start_time_ns for n in nodes if n.name == f"step{steps - 1}")
    totals = sorted(
        (n.start_time_ns, n.extra_fields.total_allocated)
        for n in nodes
        if n.tag == _EventType.Allocation and str(n.extra_fields.device) == "cpu"
    )
    resident = [total for t, total in totals if t <= last][-1]
    # Everything of the window is freed by its end (run() returned): what the total still
    # counts is a free the reporter missed (made on a thread the profiler does not follow).
    return {"peak": max(t for _, t in totals), "resident": resident, "missed": totals[-1][1]}


MISSED_OK = 1 << 20  # bytes the allocator's total may still count when the window ends
TRIES = 3


def measure(name: str, spec: dict[str, Any], how: str, steps: int) -> dict[str, Any]:
    """``how`` measured in a fresh process; an alloc run whose total missed a free (it can
    only count too much) is run again, up to TRIES times."""
    for _ in range(TRIES):
        out = _measure_once(name, spec, how, steps)
        if out.get("missed", 0) <= MISSED_OK:
            return out
    raise RuntimeError(f"{name}: the allocator's total missed frees in {TRIES} runs")


def _measure_once(name: str, spec: dict[str, Any], how: str, steps: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MKL_DISABLE_FAST_MM": "1",
        "OMP_NUM_THREADS": "2",
        "PYTHONPATH": str(REPO),
    }
    if spec.get("ranks", 1) > 1:
        env["OMP_NUM_THREADS"] = "1"  # a core a rank
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, __file__, "--child", json.dumps(spec), how, str(steps), tmp]
        procs = [
            subprocess.Popen(
                [*argv, str(rank)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for rank in range(spec.get("ranks", 1))
        ]
        outputs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode:
            raise RuntimeError(f"{name} ({how}) failed:\n{err.decode()[-2000:]}")
    return dict(json.loads(outputs[0][0].decode().strip().splitlines()[-1]))  # rank 0


def _config(spec: dict[str, Any]) -> Any:
    from trainer.config import TrainConfig

    train = {k: v for k, v in spec.items() if k != "ranks"}
    return TrainConfig.model_validate({"batch": BATCH, **train, "eval": {"every": 0}})


def estimate(spec: dict[str, Any]) -> dict[str, Any]:
    from trainer.plan import plan

    return plan(_config(spec), procs_per_node=spec.get("ranks", 1), nodes=1)


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="config names")
    args = p.parse_args()
    names = args.only or list(CONFIGS)
    batch = f"micro-batch {BATCH['micro_batch_size']} x seq_len unless named"
    print(f"{batch}; 1 rank (gloo, as under torchrun); MiB; error = estimate / alloc")
    header = (
        f"{'config':<24}{'params ok':>10}{'estimate':>10}{'alloc':>10}{'rss':>10}{'error':>8}"
        f"  | {'est stay':>9}{'meas stay':>10}{'est step':>9}{'meas step':>10}"
    )
    print(header)
    for name in names:
        spec = CONFIGS[name]
        plan = estimate(spec)
        dev = plan["memory"]["device"]
        alloc = measure(name, spec, "alloc", args.steps)
        rss = measure(name, spec, "rss", args.steps)
        counts = plan["parameters"]
        if spec.get("strategy") == "fsdp":  # the shards and their moments
            stay = dev["weights"] + dev["optimizer"]
        else:  # the fp32 weights (not autocast's copies), the moments, DDP's buckets
            stay = 4 * counts["total"] + dev["optimizer"] + 4 * counts["trainable"]
        params_ok = "yes" if plan["parameters"]["total"] == alloc["params"] else "NO"
        print(
            f"{name:<24}{params_ok:>10}{mib(dev['total']):>10}{mib(alloc['peak']):>10}"
            f"{mib(rss['peak']):>10}{dev['total'] / alloc['peak']:>8.2f}"
            f"  | {mib(stay):>9}{mib(alloc['resident']):>10}"
            f"{mib(dev['total'] - stay):>9}{mib(alloc['peak'] - alloc['resident']):>10}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        spec_arg, how_arg, steps_arg, tmp_arg, rank_arg = sys.argv[2:7]
        spec_in = json.loads(spec_arg)
        out = child(spec_in, how_arg, int(steps_arg), f"{tmp_arg}/store", int(rank_arg))
        print(json.dumps(out))
    else:
        main()
