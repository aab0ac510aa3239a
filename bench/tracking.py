"""What the experiment trackers cost a training step (trainer.tracking; issue 27: "a tracker
that is down or slow never fails or slows the job").

One process, a small MLP's forward/backward/AdamW step on the CPU, a metric record logged
every step through ``MetricsLogger`` as rank 0 does (metrics.jsonl; no Redis), in rounds
that alternate: no tracker; MLflow at a server that accepts and never answers (every
request waits its timeout); W&B offline (a real run written to disk by wandb's service).
Prints each one's median and p90 step time, the median of the run's second half (after the
trackers' imports), its whole run's wall time (the trackers' start-up happens during the
run: importing mlflow or wandb on the tracker's thread takes the GIL from the training thread
for a few seconds, once; the run's end waits for them at most ``CLOSE_S``), and the ratios
to no tracker.

    python bench/tracking.py [--steps 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import TrackingConfig
from trainer.env import TrainerEnv
from trainer.metrics import MetricsLogger


def run(tracking: TrackingConfig | None, steps: int, root: Path, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    run_dir = root / name
    run_dir.mkdir(parents=True)
    env = TrainerEnv(job_id=name, tracking_allow_private=True)
    t0 = time.perf_counter()
    metrics = MetricsLogger(run_dir, env, enabled=True, tracking=tracking, params={"a": 1})
    times = []
    for step in range(1, steps + 1):
        s = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics.log({"step": step, "steps": steps, "time": time.time(), "loss": loss.item()})
        times.append(time.perf_counter() - s)
    end = time.perf_counter()
    metrics.close()
    return {"times": times, "wall": time.perf_counter() - t0, "close": time.perf_counter() - end}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"
    slow = socket.socket()  # listens, never accepts: a tracker that is up and never answers
    slow.bind(("127.0.0.1", 0))
    slow.listen(64)
    variants: dict[str, TrackingConfig | None] = {
        "none": None,
        "mlflow-slow": TrackingConfig.model_validate(
            {"mlflow": {"tracking_uri": f"http://127.0.0.1:{slow.getsockname()[1]}"}}
        ),
        "wandb-offline": TrackingConfig.model_validate(
            {"wandb": {"project": "bench", "mode": "offline"}}
        ),
    }
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                results[name].append(run(variants[name], args.steps, Path(tmp), f"{name}-{r}"))
    slow.close()

    def summary(name: str) -> tuple[float, float, float, float, float]:
        times = [t for res in results[name] for t in res["times"]]
        late = [t for res in results[name] for t in res["times"][len(res["times"]) // 2 :]]
        q = statistics.quantiles(times, n=10)
        wall = statistics.median(res["wall"] for res in results[name])
        close = statistics.median(res["close"] for res in results[name])
        p50, late50 = statistics.median(times) * 1e3, statistics.median(late) * 1e3
        return p50, q[8] * 1e3, late50, wall, close

    base = summary("none")
    print(f"{args.steps} steps x {args.rounds} rounds, alternated; ms per step, s per run")
    print("late: the run's second half, after the trackers' libraries are imported and started")
    print(f"{'variant':15} {'p50 ms':>8} {'p90 ms':>8} {'late p50':>9} {'run s':>7} {'close s':>8} "
          f"{'p50/none':>9} {'late/none':>10} {'run/none':>9}")  # fmt: skip
    for name in variants:
        p50, p90, late, wall, close = summary(name)
        print(f"{name:15} {p50:8.3f} {p90:8.3f} {late:9.3f} {wall:7.2f} {close:8.2f} "
              f"{p50 / base[0]:9.3f} {late / base[2]:10.3f} {wall / base[3]:9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
