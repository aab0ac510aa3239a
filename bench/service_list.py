"""GET /v1/jobs with 100,000 jobs stored against 1,000: first page and a page deep in the list.

    .venv/bin/python bench/service_list.py [--big 100000] [--small 1000] [--connections 1]
                                           [--duration 5] [--rounds 2] [--limit 50]

Two fresh PostgreSQL databases, migrated, filled straight through SQLAlchemy Core (bulk
executemany of job rows as ``crud.create_job`` writes them, ids time-ordered like
``models.new_job_id``, all owned by the bench token's owner; then ANALYZE), each served by
its own uvicorn ``service.api.app:create_app`` with the same settings. Each is listed by wrk
(one thread, keep-alive, ``--connections``; 1 by default, so p50 is the service time rather
than queueing) on the first page and on a deep page whose cursor is made with the service's
own ``crud.encode_cursor`` from the row 90% of the way down (row ~90,000 of 100,000; ~900 of
1,000), alternating small/big per round.

Goals (issue 3): p50 <= 10 ms with 100,000 stored; big/small p50 <= 1.2x.
"""

from __future__ import annotations

import argparse
import functools
import secrets
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sqlalchemy as sa
from _load import wrk
from _util import SHARED_CORES_NOTE, Server, Stack, alternate, median, stack, verdict

from service.api.core.models import JOBS
from service.api.jobs.crud import encode_cursor
from trainer.config import TrainConfig

STATUSES = ("succeeded",) * 7 + ("failed", "cancelled", "running")


def job_rows(n: int, owner: str, start: int) -> list[dict[str, Any]]:
    """``n`` job rows, oldest first, one millisecond apart from ``now - n`` ms on."""
    train = TrainConfig().model_dump(mode="json")
    now_ms = int(time.time() * 1000)
    rows = []
    for i in range(start, start + n):
        ms = now_ms - 10 * (n + start) + 10 * i
        created = datetime.fromtimestamp(ms / 1000, UTC)
        status = STATUSES[i % len(STATUSES)]
        rows.append(
            {
                "id": f"{ms:012x}{secrets.token_hex(4)}",
                "owner": owner,
                "name": f"bench-{i}",
                "queue": "cpu",
                "labels": {"team": "bench", "n": str(i % 10)},
                "nodes": 1,
                "procs_per_node": 2,
                "max_runtime_s": 3600,
                "retries": 1,
                "train": train,
                "spec_hash": secrets.token_hex(32),
                "idempotency_key": None,
                "status": status,
                "reason": "exit_code" if status == "failed" else None,
                "message": None,
                "attempt": 1,
                "retries_used": 0,
                "created_at": created,
                "started_at": created + timedelta(seconds=1),
                "ended_at": None if status == "running" else created + timedelta(seconds=60),
                "metric_attempt": 1,
                "last_step": 200,
                "last_metrics": {
                    "step": 200,
                    "steps": 200,
                    "loss": 3.1,
                    "val_loss": 3.2,
                    "tokens_per_s": 1.1e5,
                    "mfu": None,
                },
            }
        )
    return rows


def fill(pg_url: str, n: int, owner: str) -> list[str]:
    """Bulk-insert ``n`` jobs; their ids newest first (the list's order)."""
    engine = sa.create_engine(pg_url)
    ids: list[str] = []
    t0 = time.perf_counter()
    try:
        with engine.begin() as conn:
            for start in range(0, n, 5000):
                rows = job_rows(min(5000, n - start), owner, start)
                conn.execute(sa.insert(JOBS), rows)
                ids.extend(r["id"] for r in rows)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE jobs"))
    finally:
        engine.dispose()
    print(f"stored {n} jobs in {time.perf_counter() - t0:.1f}s")
    ids.sort(reverse=True)
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", type=int, default=100_000)
    p.add_argument("--small", type=int, default=1_000)
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers, both servers")
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limit", type=int, default=50, help="page size asked for")
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)

    with ExitStack() as es:
        stacks: dict[str, Stack] = {}
        servers: dict[str, Server] = {}
        urls: dict[str, str] = {}
        for label, n in (("small", args.small), ("big", args.big)):
            s = es.enter_context(stack())
            stacks[label] = s
            ids = fill(s.pg_url, n, s.owner)
            servers[label] = s.serve_api(args.workers, **api_env)
            deep = ids[int(len(ids) * 0.9)]
            base = f"{servers[label].url}/v1/jobs?limit={args.limit}"
            urls[f"{label}/first"] = base
            urls[f"{label}/deep"] = f"{base}&cursor={encode_cursor(deep)}"

        def one(key: str) -> dict[str, float]:
            label = key.split("/")[0]
            return wrk(
                urls[key],
                connections=args.connections,
                duration_s=args.duration,
                headers=stacks[label].auth,
                tmp=stacks[label].tmp,
            )

        for key in urls:  # warm-up: pools, token cache, the planner's statistics
            wrk(
                urls[key],
                connections=args.connections,
                duration_s=1,
                headers=stacks[key.split("/")[0]].auth,
                tmp=stacks[key.split("/")[0]].tmp,
            )
        results = alternate(args.rounds, {k: functools.partial(one, k) for k in urls})

    print(
        f"\nGET /v1/jobs?limit={args.limit}: {args.small} vs {args.big} jobs stored; uvicorn"
        f" --workers {args.workers}; wrk -t1 -c{args.connections} -d{args.duration:.0f}s,"
        f" {args.rounds} runs each, alternated; service settings {api_env or 'defaults'}"
    )
    print(SHARED_CORES_NOTE)
    print(f"{'case':<14} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'errors':>7}")
    med: dict[str, dict[str, float]] = {}
    for key, runs in results.items():
        m = {k: median([r[k] for r in runs]) for k in ("rps", "p50_ms", "p90_ms", "p99_ms")}
        m["errors"] = sum(r["errors"] for r in runs)
        med[key] = m
        print(
            f"{key:<14} {m['rps']:>8.0f} {m['p50_ms']:>8.2f} {m['p90_ms']:>8.2f}"
            f" {m['p99_ms']:>8.2f} {m['errors']:>7.0f}"
        )
    for page in ("first", "deep"):
        big, small = med[f"big/{page}"], med[f"small/{page}"]
        ratio = big["p50_ms"] / small["p50_ms"]
        print(
            f"{page} page: p50 {big['p50_ms']:.2f} ms with {args.big} stored (goal <= 10 ms:"
            f" {verdict(big['p50_ms'] <= 10)}); vs {args.small} stored {ratio:.2f}x"
            f" (goal <= 1.2x: {verdict(ratio <= 1.2)})"
        )


if __name__ == "__main__":
    main()
