"""The GPU script: one table of what trainq's trainer does on a CUDA machine, in < 8 minutes.

    .venv/bin/python bench/gpu/run.py            # a CUDA machine (all its GPUs, torchrun)
    .venv/bin/python bench/gpu/run.py --dry      # every row's code path, tiny, on the CPU

Every training row is ``torchrun --standalone --nproc-per-node <GPUs> -m trainer --config``
(bench/gpu/_jobs.py), trainq's own trainer and nothing else; figures are the trainer's own
metrics (metrics.jsonl: tokens_per_s, mfu against trainer.metrics' dense peak for the
device, mem_peak_bytes), medians over the steps after the first five (compile, warm-up):

1. bf16 FSDP2 + torch.compile, a ~350M and a ~1B llama (byte vocabulary, seq 2048): tokens/s
   and MFU;
2. the same for a small moe (``family: moe``), or a line saying the family is not known;
3. DDP vs FSDP2 per-step losses, fp32, under NCCL (2 ranks when there are 2 GPUs): the
   largest difference (goal < 1e-4, as on CPU);
4. fp16 with GradScaler (DDP): tokens/s, every loss finite, the last below the first;
5. FSDP2 CPU offload on the ~350M llama (bf16, no compile) against the same without it:
   tokens/s and peak device memory of each;
6. generation: ``trainer.generate`` (KV cache, greedy) on the GPU against transformers
   ``generate`` on the same weights (the ~350M checkpoint exported as a Hugging Face
   folder, both bf16): new tokens/s each, and how many leading tokens agree.

Without CUDA it says so in one line and exits 0. ``--dry`` runs every row at tiny size on the
CPU (gloo, fp32; fp16 needs CUDA, so its row runs fp32; compile off; offload has nothing to
move): what tests/trainer/test_gpu_script.py runs, so the script works on the day a GPU is
lent.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._util import base_env
from bench.gpu._jobs import (
    Clock,
    JobFailed,
    Size,
    config,
    losses,
    moe_known,
    run_job,
    steady,
)

BUDGET_S = 7.5 * 60
SKIP = 5  # steps left out of the medians (compile and warm-up)
NEW_TOKENS = 200
PROMPT = b"The sea was calm that night, and "


class Rows:
    """The table, a row at a time (also printed as each row ends, to stderr)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, name: str, result: str, detail: str = "") -> None:
        self.rows.append((name, result, detail))
        print(f"[gpu] {name}: {result}  {detail}", file=sys.stderr, flush=True)

    def table(self) -> str:
        head = ("row", "result", "detail")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(2)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in [head, *self.rows]]
        return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _rate(records: list[dict[str, Any]], skip: int) -> tuple[str, str]:
    tok_s, mfu = steady(records, "tokens_per_s", skip), steady(records, "mfu", skip)
    mem = max((r.get("mem_peak_bytes") or 0) for r in records)
    result = f"{tok_s:,.0f} tok/s" if tok_s else "-"
    result += f"  MFU {100 * mfu:.1f}%" if mfu else "  MFU -"
    return result, f"peak mem {mem / 2**30:.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="every row at tiny size on the CPU")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all rows")
    args = p.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry:
        print("bench/gpu/run.py: no CUDA device here (torch.cuda.is_available() is False);"
              " nothing to measure (--dry runs every row's code path on the CPU)")  # fmt: skip
        return 0
    size, clock, rows = Size(dry=not cuda), Clock(args.budget), Rows()
    gpus = torch.cuda.device_count() if cuda else 1  # dry: one rank a row, two where compared
    skip = 0 if size.dry else SKIP
    env = base_env()
    if cuda:
        from trainer.metrics import peak_flops

        name = torch.cuda.get_device_name(0)
        peak = peak_flops(torch.device("cuda", 0), "bf16")
        said = f"{peak / 1e12:.0f} TFLOPS dense bf16" if peak else "peak unknown: no MFU"
        print(f"device: {name} x{gpus} ({said}, trainer.metrics); torch {torch.__version__}")
    else:
        print(f"device: CPU (--dry: gloo, fp32, tiny models); torch {torch.__version__}")

    from trainer.prepare import prepare_demo

    with tempfile.TemporaryDirectory(prefix="trainq-gpu-") as tmp:
        work = Path(tmp)
        prepare_demo(work / "data" / "demo")

        def job(name: str, cfg: dict[str, Any], nproc: int = gpus) -> Any:
            return run_job(name, cfg, work, work / "data", nproc, clock.left(), env)

        def row(name: str, fn: Any) -> None:
            if clock.left() < 20:
                rows.add(name, "skipped", f"the {args.budget:.0f}s budget is spent")
                return
            try:
                fn(name)
            except JobFailed as exc:
                rows.add(name, "FAILED", str(exc).splitlines()[0])
                print(exc, file=sys.stderr)

        fsdp_bf16 = {"compile": not size.dry}
        generation_run: list[Path] = []

        def dense(params: str, d: int, layers: int, micro: int) -> Any:
            def go(name: str) -> None:
                if size.dry and generation_run:  # the same code path as the row above
                    rows.add(name, "dry: not run again", "the row above's code path, tiny")
                    return
                model = size.llama(d, layers, 16, 2048)
                cfg = config(size, model, strategy="fsdp", micro=size.micro(micro), **fsdp_bf16)
                run_dir, records = job(name.split()[0], cfg)
                if not generation_run:
                    generation_run.append(run_dir)
                result, detail = _rate(records, skip)
                shape = "tiny (dry)" if size.dry else f"{params}, seq 2048, micro {micro}"
                rows.add(name, result, f"{shape}; {detail}")

            return go

        row("llama-350m fsdp2 bf16 compile", dense("~354M", 1024, 28, 4))
        row("llama-1b fsdp2 bf16 compile", dense("~1.0B", 2048, 20, 2))

        def moe(name: str) -> None:
            why = moe_known()
            if why is not None:
                rows.add(name, "skipped", why)
                return
            cfg = config(size, size.moe(), strategy="fsdp", micro=size.micro(4), **fsdp_bf16)
            _, records = job("moe", cfg)
            result, detail = _rate(records, skip)
            rows.add(
                name, result, f"8 experts, top 2 (MFU: the family's flops_per_token); {detail}"
            )

        row("moe fsdp2 bf16 compile", moe)

        def equal(name: str) -> None:
            ranks = min(2, gpus) if cuda else 2
            model = size.llama(256, 4, 4, 256)
            base = dict(size=size, model=model, micro=size.micro(4), steps=3 if size.dry else 10)
            fp32 = {"precision": "fp32"}
            ddp = losses(job("eq-ddp", {**config(strategy="ddp", **base), **fp32}, ranks)[1])
            fsdp = losses(job("eq-fsdp", {**config(strategy="fsdp", **base), **fp32}, ranks)[1])
            worst = max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True))
            verdict = "ok" if worst < 1e-4 else "OVER 1e-4"
            backend = "nccl" if cuda else "gloo"
            rows.add(name, f"max |dloss| {worst:.2e} {verdict}",
                     f"{len(ddp)} steps, fp32, {ranks} rank(s), {backend}")  # fmt: skip

        row("ddp vs fsdp2 losses", equal)

        def fp16(name: str) -> None:
            model = size.llama(1024, 12, 16, 1024)
            precision = "fp16" if cuda else "fp32"  # the trainer refuses fp16 without CUDA
            cfg = config(size, model, strategy="ddp", micro=size.micro(4))
            _, records = job("fp16", {**cfg, "precision": precision})
            seen = losses(records)
            finite = all(x == x and abs(x) != float("inf") for x in seen)
            result, detail = _rate(records, skip)
            ok = "losses finite, falling" if finite and seen[-1] < seen[0] else "LOSS NOT FALLING"
            rows.add(name, result, f"{precision}{'' if cuda else ' (dry)'}, {ok}; {detail}")

        row("fp16 ddp + GradScaler", fp16)

        def offload(name: str) -> None:
            model = size.llama(1024, 28, 16, 2048)
            micro, steps = size.micro(4), 12 if cuda else 3
            on = config(size, model, strategy="fsdp", micro=micro, steps=steps,
                        fsdp={"cpu_offload": True})  # fmt: skip
            _, with_records = job("offload-on", on)
            a = steady(with_records, "tokens_per_s", 2) or 0.0
            mem_on = max((r.get("mem_peak_bytes") or 0) for r in with_records) / 2**30
            if size.dry:  # on the CPU there is nothing to offload: nothing to compare with
                rows.add(name, f"{a:,.0f} tok/s", "dry: the offload config runs; no comparison")
                return
            off = config(size, model, strategy="fsdp", micro=micro, steps=steps)
            _, without = job("offload-off", off)
            b = steady(without, "tokens_per_s", 2) or 0.0
            mem_off = max((r.get("mem_peak_bytes") or 0) for r in without) / 2**30
            ratio = f"{a / b:.2f}x" if b else "-"
            mem = f"peak device mem {mem_on:.2f} vs {mem_off:.2f} GiB (offload vs not)"
            rows.add(name, f"{a:,.0f} vs {b:,.0f} tok/s ({ratio})", mem)

        row("fsdp2 cpu offload vs none", offload)

        def generation(name: str) -> None:
            if not generation_run:
                rows.add(name, "skipped", "no checkpoint: the first row did not run")
                return
            ours, theirs, agree, new = generate_pair(generation_run[0], work / "hf", cuda)
            rows.add(name, f"{ours:,.0f} vs {theirs:,.0f} tok/s ({ours / theirs:.2f}x)",
                     f"trainer.generate vs transformers generate, {new} greedy tokens,"
                     f" {agree}/{new} leading tokens agree")  # fmt: skip

        row("generation vs transformers", generation)
    print(rows.table())
    return 0


def generate_pair(run_dir: Path, folder: Path, cuda: bool) -> tuple[float, float, int, int]:
    """New tokens/s of trainer.generate and of transformers' generate (greedy, cached) on the
    run's last checkpoint, on the GPU in bf16 (the CPU in fp32); their common prefix and the
    number of new tokens each made."""
    import torch
    import transformers

    from trainer.export import export, load_model
    from trainer.generate import Sampling, generate_ids

    model, _ = load_model(run_dir)
    export(model, folder, "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model, hf = model.to(device, dtype), hf.to(device, dtype)
    prompt = list(PROMPT)[: model.cfg.seq_len // 2]
    new = min(NEW_TOKENS, model.cfg.seq_len - len(prompt))
    ids = torch.tensor([prompt], device=device)
    greedy = Sampling(max_tokens=new, temperature=0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def ours() -> tuple[float, list[int]]:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = [int(t) for t in generate_ids(model, prompt, greedy)]
        sync()
        return len(out) / (time.perf_counter() - t0), out

    def theirs() -> tuple[float, list[int]]:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)  # fmt: skip
        sync()
        got = out[0, len(prompt) :].tolist()
        return len(got) / (time.perf_counter() - t0), got

    ours(), theirs()  # warm both (kernels, caches)
    (a, mine), (b, other) = ours(), theirs()
    pairs = list(zip(mine, other, strict=False))
    agree = next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs))
    return a, b, agree, new


if __name__ == "__main__":
    raise SystemExit(main())
