"""Generation: tokens/s on a warm worker against transformers' generate, and the time to the
first token at the client.

    .venv/bin/python bench/generate.py [--rounds 3] [--first 20]

A real system (bench._util.stack: PostgreSQL, Redis, the API under uvicorn, one worker
``python -m worker``) trains a small GPT (4 layers, width 256, context 512, bytes) for two
steps, then:

- throughput: one request, 256 new tokens, greedy, KV cache, through POST /v1/completions
  to the warm worker; tokens/s from the worker's own generation time (``trainq.generate_s``)
  and from the client's wall time; against ``transformers`` ``generate`` (greedy, its
  cache) on the same weights exported as a Hugging Face folder, in a plain Python process
  (this one) with the same torch threads (``--threads``, default 1: on 2 shared, busy
  cores a second intra-op thread mostly spins; the worker's TRAINQ_GENERATE_TORCH_THREADS),
  and ``trainer.generate`` in this same process (the like-for-like pair). Alternated A B C / C B A
  so drift cancels. Goal >= 1.0.
- first token: streamed requests, the time from sending to the first chunk with text, p50
  over ``--first`` warm requests (goal <= 150 ms), and cold (the checkpoint loaded by the
  request) beside it, once per checkpoint kept.

The machine has 2 shared cores: the API, Redis, PostgreSQL, the worker and this process
share them, which the numbers include.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import alternate, median, percentiles, stack, start_worker, stop_worker, train_job

QUEUE = "bench-gen"
NEW_TOKENS = 256
PROMPT = "A cold wind came from the sea, and "
TRAIN = {
    "steps": 2,
    "seed": 1,
    "model": {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 512, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 1},
    "eval": {"every": 0},
    "checkpoint": {"every": 1, "keep": 2},
}


def first_token_s(client: httpx.Client, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        elapsed = None
        for line in r.iter_lines():  # read to the end: the request is complete
            if elapsed is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(c.get("token_ids") for c in chunk.get("choices", ())):
                    elapsed = time.perf_counter() - t0
    assert elapsed is not None
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    args = p.parse_args()

    import torch
    import transformers

    from trainer.export import export, load_model
    from trainer.generate import Sampling, generate_ids
    from trainer.prepare import prepare_demo

    with stack("bench-gen") as s:
        prepare_demo(s.tmp / "data" / "demo")
        api = s.serve_api(1)
        env = s.env(TRAINQ_GENERATE_TORCH_THREADS=str(args.threads))
        torch.set_num_threads(args.threads)
        worker = start_worker(env, QUEUE, "bench-gen", s.tmp / "worker.log")
        try:
            client = httpx.Client(base_url=api.url, headers=s.auth, timeout=300)
            job = train_job(client, QUEUE, "gen", TRAIN, s.tmp / "worker.log")
            run_dir = s.tmp / "runs" / job

            # Cold first tokens: each kept checkpoint is loaded by its first request.
            cold = [first_token_s(client, f"{job}:{step}") for step in (1, 2)]
            warm = [first_token_s(client, job) for _ in range(args.first)]

            # Throughput, ours vs transformers on the same weights (alternated).
            model, _ = load_model(run_dir)
            folder = Path(tempfile.mkdtemp()) / "hf"
            export(model, folder, "hf")
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            ids = torch.tensor([list(PROMPT.encode())])
            body = {"model": job, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}

            def ours() -> tuple[float, float]:
                t0 = time.perf_counter()
                out = client.post("/v1/completions", json=body).json()
                wall = time.perf_counter() - t0
                n = out["usage"]["completion_tokens"]
                assert n == NEW_TOKENS, out
                return n / out["trainq"]["generate_s"], n / wall

            def theirs() -> float:
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=0, min_new_tokens=NEW_TOKENS)  # fmt: skip
                assert out.shape[1] - ids.shape[1] == NEW_TOKENS
                return NEW_TOKENS / (time.perf_counter() - t0)

            def local() -> float:
                t0 = time.perf_counter()
                params = Sampling(max_tokens=NEW_TOKENS, temperature=0)
                n = sum(1 for _ in generate_ids(model, ids[0].tolist(), params))
                assert n == NEW_TOKENS
                return n / (time.perf_counter() - t0)

            ours(), theirs(), local()  # warm all three
            runs = alternate(args.rounds, {"worker": ours, "hf": theirs, "local": local})
            a, b, c = runs["worker"], runs["hf"], runs["local"]
        finally:
            stop_worker(worker)

    worker_tps = median([x[0] for x in a])
    client_tps = median([x[1] for x in a])
    hf_tps = median(b)
    local_tps = median(c)
    print(f"generation, {NEW_TOKENS} new tokens, greedy, KV cache; GPT 4x256, ctx 512, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
          f"torch threads {torch.get_num_threads()}; {args.rounds} rounds alternated")  # fmt: skip
    print(f"  trainq worker (generate_s):      {worker_tps:8.1f} tok/s")
    print(f"  trainq through the API (client): {client_tps:8.1f} tok/s")
    print(f"  transformers generate (here):    {hf_tps:8.1f} tok/s")
    print(f"  trainer.generate (here):         {local_tps:8.1f} tok/s")
    print(f"  ratio worker/transformers {worker_tps / hf_tps:.2f}, "
          f"client/transformers {client_tps / hf_tps:.2f}; same process: "
          f"trainer.generate/transformers {local_tps / hf_tps:.2f} (goal >= 1.0)")  # fmt: skip
    pw = percentiles(warm)
    print(f"first token at the client, streamed: warm p50 {pw['p50']:.1f} ms "
          f"(p90 {pw['p90']:.1f}, n={len(warm)}; goal <= 150 ms); "
          f"cold (the checkpoint loaded by the request): {cold[0] * 1000:.0f} ms for the "
          f"worker's first (torch imported too), {cold[1] * 1000:.0f} ms for another")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
