"""Batched generation: 8 concurrent greedy requests of 64 tokens to one warm worker against
the same 8 sent one after another, and against transformers' ``generate`` on a batch of 8.

    .venv/bin/python bench/generate_batch.py [--rounds 3] [--threads 1] [--device cpu]

A real system (bench._util.stack: PostgreSQL, Redis, the API under uvicorn, one worker
``python -m worker``, TRAINQ_GENERATE_BATCH 8) trains a small Llama (4 layers, width 256,
context 512, bytes) for two steps, then, on 8 different prompts (4 to 40 tokens):

- concurrent: 8 client threads each POST /v1/completions (``max_tokens`` 64, greedy) at
  once; the worker decodes them as one batch (its start events' ``batch``). Total tokens
  / client wall time.
- sequential: the same 8 requests one after another (each decoded alone).
- transformers: ``generate`` on the 8 prompts left-padded into one batch (attention mask,
  its cache, greedy, exactly 64 new tokens) on the same weights exported as a Hugging Face
  folder, in this process, with the same torch threads and device as the worker.

Each side is run ``--rounds`` times, alternated so drift cancels; medians printed side by
side with the ratios (goals: concurrent/sequential >= 3, concurrent/transformers >= 1.0),
from the client's wall time and from the worker's own decoding time (``trainq.generate_s``:
the concurrent batch's longest, the sequential requests' sum), which leaves out the API.
On a CPU host the API, Redis, PostgreSQL, the worker and this process share the cores,
which the numbers include.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import alternate, median, stack, start_worker, stop_worker, train_job

QUEUE = "bench-batch"
BATCH = 8
NEW_TOKENS = 64
PROMPTS = [
    "A cold wind came from the sea, and the",
    "Once",
    "The ship",
    "In the morning the harbour was grey and",
    "She said that",
    "Far to the north, beyond the mountains,",
    "It was",
    "The old man looked at the sky",
]
TRAIN = {
    "steps": 2,
    "seed": 1,
    "model": {"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 256,
              "seq_len": 512, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 1},
    "eval": {"every": 0},
    "checkpoint": {"every": 1, "keep": 1},
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--device", default="cpu", help="torch device, both sides")
    args = p.parse_args()

    import torch
    import transformers

    from trainer.export import export, load_model
    from trainer.prepare import prepare_demo

    with stack("bench-batch") as s:
        prepare_demo(s.tmp / "data" / "demo")
        api = s.serve_api(1)
        env = s.env(
            TRAINQ_GENERATE_TORCH_THREADS=str(args.threads),
            TRAINQ_GENERATE_BATCH=str(BATCH),
            TRAINQ_GENERATE_DEVICE=args.device,
        )
        torch.set_num_threads(args.threads)
        worker = start_worker(env, QUEUE, "bench-batch", s.tmp / "worker.log")
        try:
            client = httpx.Client(base_url=api.url, headers=s.auth, timeout=600)
            job = train_job(client, QUEUE, "batch", TRAIN, s.tmp / "worker.log")
            run_dir = s.tmp / "runs" / job
            model, _ = load_model(run_dir)
            folder = Path(tempfile.mkdtemp()) / "hf"
            export(model, folder, "hf")
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder).to(args.device).eval()
            width = max(len(p.encode()) for p in PROMPTS)
            ids = torch.tensor([[0] * (width - len(p.encode())) + list(p.encode())
                                for p in PROMPTS], device=args.device)  # fmt: skip
            mask = torch.tensor([[0] * (width - len(p.encode())) + [1] * len(p.encode())
                                 for p in PROMPTS], device=args.device)  # fmt: skip
            texts: dict[str, list[str]] = {}
            spans: list[float] = []  # the worker's own time for the concurrent batch
            alone: list[float] = []  # and for the sequential requests, summed

            def one(prompt: str) -> dict[str, Any]:
                body = {"model": job, "prompt": prompt, "max_tokens": NEW_TOKENS,
                        "temperature": 0}  # fmt: skip
                # One client for every thread, its connections kept, as SDK clients do: a
                # new httpx client a request costs ~40 ms of this process's CPU (its SSL
                # context), which 8 threads pay under one GIL before their requests leave.
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                out: dict[str, Any] = r.json()
                assert out["usage"]["completion_tokens"] == NEW_TOKENS, out
                return out

            def concurrent() -> float:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(BATCH) as pool:
                    outs = list(pool.map(one, PROMPTS))
                took = time.perf_counter() - t0
                texts["concurrent"] = [o["choices"][0]["text"] for o in outs]
                spans.append(max(o["trainq"]["generate_s"] for o in outs))
                return BATCH * NEW_TOKENS / took

            def sequential() -> float:
                t0 = time.perf_counter()
                outs = [one(p) for p in PROMPTS]
                took = time.perf_counter() - t0
                texts["sequential"] = [o["choices"][0]["text"] for o in outs]
                alone.append(sum(o["trainq"]["generate_s"] for o in outs))
                return BATCH * NEW_TOKENS / took

            def theirs() -> float:
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=0)  # fmt: skip
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                took = time.perf_counter() - t0
                assert out.shape[1] - width == NEW_TOKENS
                return BATCH * NEW_TOKENS / took

            concurrent(), sequential(), theirs()  # warm all three
            runs = alternate(args.rounds, {"concurrent": concurrent, "sequential": sequential,
                                           "transformers": theirs})  # fmt: skip
            same = texts["concurrent"] == texts["sequential"]
            log = (s.tmp / "worker.log").read_text(errors="replace")
            batches = [int(x.split(")")[0]) for x in log.split("(batch ")[1:]]
        finally:
            stop_worker(worker)

    conc, seq, hf_tps = (median(runs[k]) for k in ("concurrent", "sequential", "transformers"))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"batched generation: {BATCH} prompts x {NEW_TOKENS} new tokens, greedy; Llama 4x256 "
          f"(GQA 4/2), ctx 512, {params:.1f}M params; device {args.device}, torch threads "
          f"{args.threads}; {args.rounds} rounds alternated; worker batch sizes seen "
          f"{sorted(set(batches))}")  # fmt: skip
    print(f"  trainq, {BATCH} concurrent requests (client wall): {conc:8.1f} tok/s")
    w_conc, w_seq = BATCH * NEW_TOKENS / median(spans), BATCH * NEW_TOKENS / median(alone)
    print(f"  trainq, {BATCH} sequential requests (client wall): {seq:8.1f} tok/s")
    print(f"  transformers generate, batch of {BATCH} (here):     {hf_tps:8.1f} tok/s")
    print(f"  ratio concurrent/sequential {conc / seq:.2f} (goal >= 3) | "
          f"concurrent/transformers {conc / hf_tps:.2f} (goal >= 1.0) | "
          f"texts concurrent == sequential: {same}")  # fmt: skip
    print(f"  the worker's own decoding time (trainq.generate_s): concurrent {w_conc:.1f} tok/s, "
          f"sequential {w_seq:.1f} tok/s; ratio concurrent/sequential {w_conc / w_seq:.2f} | "
          f"concurrent/transformers {w_conc / hf_tps:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
