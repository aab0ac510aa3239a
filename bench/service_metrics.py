"""GET /v1/jobs/{id}/metrics?max_points=2000 for a job with 100,000 metric rows.

    .venv/bin/python bench/service_metrics.py [--rows 100000] [--points 2000] [--requests 8]
                                              [--compare-tree /tmp/trainq-proto]

One fresh PostgreSQL database, migrated; a job submitted through the API and ``--rows``
metric rows (one per step, attempt 1) bulk-inserted through SQLAlchemy Core, as the
ingestor stores them; then ANALYZE. The API (uvicorn ``service.api.app:create_app``) is asked
for the downsampled history ``--requests`` times, one at a time. With ``--compare-tree``, a
second API is served from that copy of the repository (same database, same settings) and
the two are alternated A B / B A, and their answers are compared point by point.

Goal: the dashboard's history request well under a second (the page goal is < 1 s drawn).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import sqlalchemy as sa
from _util import SHARED_CORES_NOTE, alternate, percentiles, stack

from service.api.core.models import METRICS


def fill(pg_url: str, job_id: str, rows: int) -> None:
    engine = sa.create_engine(pg_url)
    t0 = time.perf_counter()
    try:
        with engine.begin() as conn:
            for start in range(1, rows + 1, 10_000):
                batch: list[dict[str, Any]] = []
                for step in range(start, min(rows, start + 9_999) + 1):
                    data = {
                        "step": step,
                        "steps": rows,
                        "time": 1.7e9 + step * 0.1,
                        "loss": 5.0 / (1 + step / 2000),
                        "lr": 3e-4,
                        "grad_norm": 1.0,
                        "tokens_per_s": 1e5 + step % 977,
                        "tokens_per_s_per_device": 5e4,
                        "step_time_s": 0.1,
                        "tflops": None,
                        "mfu": None,
                        "mem_peak_bytes": 1 << 30,
                        "data_wait_frac": 0.01,
                        **({"val_loss": 5.2 / (1 + step / 2000)} if step % 100 == 0 else {}),
                    }
                    batch.append(
                        {
                            "job_id": job_id,
                            "attempt": 1,
                            "step": step,
                            "ts": 1.7e9 + step * 0.1,
                            "data": data,
                        }
                    )
                conn.execute(sa.insert(METRICS), batch)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE metrics"))
    finally:
        engine.dispose()
    print(f"stored {rows} metric rows in {time.perf_counter() - t0:.1f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--points", type=int, default=2000, help="max_points asked for")
    p.add_argument("--requests", type=int, default=8, help="timed requests per side")
    p.add_argument("--compare-tree", type=Path, default=None, help="a copy of the repo")
    args = p.parse_args()

    with stack() as s:
        api = s.serve_api(1, TRAINQ_INGEST="false")
        with httpx.Client(base_url=api.url, headers=s.auth, timeout=120) as c:
            spec = {"name": "bench-metrics", "queue": "bench", "train": {}}
            job_id = c.post("/v1/jobs", json=spec).raise_for_status().json()["id"]
        fill(s.pg_url, job_id, args.rows)
        apis = {"shared tree": api}
        if args.compare_tree:
            apis["copy"] = s.serve_api(1, tree=args.compare_tree.resolve(), TRAINQ_INGEST="false")
        clients = {
            k: httpx.Client(base_url=v.url, headers=s.auth, timeout=120) for k, v in apis.items()
        }
        path = f"/v1/jobs/{job_id}/metrics"
        params = {"max_points": args.points}
        answers: dict[str, Any] = {}

        def one(name: str) -> float:
            t0 = time.perf_counter()
            r = clients[name].get(path, params=params)
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            answers[name] = r.json()
            return elapsed

        for name in apis:
            one(name)  # warm-up
        results = alternate(args.requests, {k: functools.partial(one, k) for k in apis})
        for c in clients.values():
            c.close()

    print(
        f"\nGET /v1/jobs/{{id}}/metrics?max_points={args.points}, {args.rows} rows stored;"
        f" {args.requests} sequential requests per side, alternated; uvicorn --workers 1"
    )
    print(SHARED_CORES_NOTE)
    for name, runs in results.items():
        lat = percentiles(runs)
        a = answers[name]
        print(
            f"{name:<12} p50 {lat['p50']:8.1f} ms  max {lat['max']:8.1f} ms   total"
            f" {a['total']}, points {len(a['points'])}, downsampled {a['downsampled']}"
        )
    if len(results) == 2:
        names = list(results)
        speedup = percentiles(results[names[0]])["p50"] / percentiles(results[names[1]])["p50"]
        same = answers[names[0]] == answers[names[1]]
        steps = [[pt["step"] for pt in answers[n]["points"]] for n in names]
        print(
            f"{names[0]} / {names[1]} p50: {speedup:.1f}x; answers identical: {same};"
            f" same steps: {steps[0] == steps[1]}"
        )


if __name__ == "__main__":
    main()
