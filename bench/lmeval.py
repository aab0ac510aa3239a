"""lm-evaluation-harness through trainq against its own ``hf`` backend: wall time, same task.

    .venv/bin/python bench/lmeval.py [--rounds 3] [--repeat 8] [--batch 8] [--concurrent 4]

A real system (bench._util.stack: PostgreSQL, Redis, the API under uvicorn, one worker
``python -m worker``) trains a small GPT (4 layers, width 128, context 256, bytes) for two
steps and the Hugging Face export of its checkpoint is downloaded through the API. Then the
shipped multiple-choice task (``examples/lmeval``, its 24 items repeated ``--repeat`` times:
4 loglikelihood requests an item) is scored by

- ``local-completions``: lm-eval's OpenAI-completions client against
  ``/models/JOB/v1/completions`` (echo + logprobs), ``--batch`` prompts a request,
  ``--concurrent`` requests at once; the worker batches what arrives together. Twice: with
  the tokenizer remote (``tokenizer_backend=remote``: lm-eval asks ``/tokenize`` for every
  context and continuation, one at a time, before it sends a request) and with the
  export's tokenizer loaded by lm-eval (``tokenizer_backend=huggingface``);
- ``hf``: lm-eval's own backend on the downloaded export, in this process, ``--batch`` a
  forward, with the worker's torch threads (``--threads``).

Alternated A B / B A so drift cancels; prints each side's median wall time and the ratio
(goal <= 1.5x), and checks the two agree on accuracy. The machine has 2 shared cores: the
API, Redis, PostgreSQL, the worker and this process share them, which the numbers include.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import (
    REPO,
    alternate,
    median,
    stack,
    start_worker,
    stop_worker,
    train_job,
    verdict,
)

QUEUE = "bench-lmeval"
TASK = "trainq_mc"
TRAIN = {
    "steps": 2,
    "seed": 1,
    "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 256, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 1},
    "eval": {"every": 0},
    "checkpoint": {"every": 2, "keep": 1, "hf": "final"},
}


def task_dir(tmp: Path, repeat: int) -> Path:
    """The shipped task with its items repeated ``repeat`` times, data path absolute."""
    src = REPO / "examples" / "lmeval"
    out = tmp / "tasks"
    out.mkdir()
    lines = (src / f"{TASK}.jsonl").read_text().splitlines()
    (out / f"{TASK}.jsonl").write_text("\n".join(lines * repeat) + "\n")
    text = (src / f"{TASK}.yaml").read_text()
    (out / f"{TASK}.yaml").write_text(
        text.replace(f"examples/lmeval/{TASK}.jsonl", str(out / f"{TASK}.jsonl"))
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=8, help="copies of the 24-item task")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    args = p.parse_args()

    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from trainer.prepare import prepare_demo

    torch.set_num_threads(args.threads)
    with stack("bench-lmeval") as s:
        prepare_demo(s.tmp / "data" / "demo")
        api = s.serve_api(1)
        env = s.env(TRAINQ_GENERATE_TORCH_THREADS=str(args.threads))
        worker = start_worker(env, QUEUE, "bench-lm", s.tmp / "worker.log")
        try:
            client = httpx.Client(base_url=api.url, headers=s.auth, timeout=300)
            job = train_job(client, QUEUE, "lm", TRAIN, s.tmp / "worker.log")
            r = client.get(f"/v1/jobs/{job}/checkpoints/latest/download",
                           params={"format": "hf"})  # fmt: skip
            assert r.status_code == 200, r.text
            export = s.tmp / "export"
            with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
                tar.extractall(export, filter="data")
            tasks = task_dir(s.tmp, args.repeat)
            manager = TaskManager(include_path=str(tasks))
            os.environ["OPENAI_API_KEY"] = s.token
            base = f"{api.url}/models/{job}/v1/completions"

            def evaluate(model: str, model_args: str) -> tuple[float, float]:
                t0 = time.perf_counter()
                out: Any = simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                           task_manager=manager, batch_size=args.batch,
                                           device="cpu")  # fmt: skip
                return time.perf_counter() - t0, out["results"][TASK]["acc,none"]

            common = (f"model={job},base_url={base},auth_token={s.token},"
                      f"num_concurrent={args.concurrent},max_retries=1,max_length=256")  # fmt: skip

            def ours() -> tuple[float, float]:
                return evaluate("local-completions", f"{common},tokenizer_backend=remote")

            def ours_local_tokenizer() -> tuple[float, float]:
                return evaluate(
                    "local-completions",
                    f"{common},tokenizer_backend=huggingface,tokenizer={export}",
                )

            def theirs() -> tuple[float, float]:
                return evaluate("hf", f"pretrained={export},dtype=float32")

            ours(), ours_local_tokenizer(), theirs()  # warm: the model, imports, task cache
            sides = {"trainq": ours, "trainq-tok": ours_local_tokenizer, "hf": theirs}
            runs = alternate(args.rounds, sides)
        finally:
            stop_worker(worker)

    a = median([t for t, _ in runs["trainq"]])
    a2 = median([t for t, _ in runs["trainq-tok"]])
    b = median([t for t, _ in runs["hf"]])
    accs = {acc for side in runs.values() for _, acc in side}
    n = 24 * args.repeat * 4
    ratio = a / b
    print(f"lm-eval {TASK}: {24 * args.repeat} items, {n} loglikelihood requests; GPT 4x128, "
          f"ctx 256; batch {args.batch}; {args.concurrent} concurrent; torch threads "
          f"{args.threads}; {args.rounds} rounds alternated")  # fmt: skip
    print(f"  through trainq, tokenizer remote:  {a:7.2f} s ({n / a:7.1f} requests/s)")
    print(f"  through trainq, export tokenizer: {a2:7.2f} s ({n / a2:7.1f} requests/s)")
    print(f"  hf backend on the export (here):  {b:7.2f} s ({n / b:7.1f} requests/s)")
    print(
        f"  ratio trainq/hf: tokenizer remote {ratio:.2f}, export tokenizer {a2 / b:.2f} "
        f"(goal <= 1.5x: {verdict(min(ratio, a2 / b) <= 1.5)}); "
        f"accuracy {json.dumps(sorted(accs))} ({'equal' if len(accs) == 1 else 'DIFFER'})"
    )
    return 0 if len(accs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
