"""POST /v1/jobs sustained: jobs/s, and none lost (2xx == rows == messages on the broker).

    .venv/bin/python bench/service_submit.py [--workers 1] [--connections 32]
                                             [--total 6000] [--max-s 30]

Stands up the service (fresh PostgreSQL, claimed Redis numbers for events and the Celery
broker, a non-admin token, uvicorn ``service.api.app:create_app`` with its ingestor and
reconciler on) and POSTs ``--total`` JSON specs (a distinct name each, no Idempotency-Key)
over ``--connections`` keep-alive connections from a small asyncio client (``_util.post_load``:
bounded by count and by ``--max-s``; every response is read and counted, so the comparison
below is exact). No worker consumes the queue, so every message sent stays on the broker.

Afterwards (once the reconciler had a chance to send anything a request did not) it counts:
2xx responses; ``jobs`` rows and ``attempts`` rows with ``sent_at`` set, in SQL; and the
messages on the Celery queue's Redis list in the broker database. None lost means all four
are equal (and no request failed).

Goal (issue 3): >= 500 jobs/s sustained, none lost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
import sqlalchemy as sa
from _load import post_load
from _util import SHARED_CORES_NOTE, percentiles, stack, verdict

QUEUE = "bench-submit"


def spec(i: int) -> bytes:
    body = {
        "name": f"bench-{i}",
        "labels": {"team": "bench", "n": str(i % 10)},
        "queue": QUEUE,
        "retries": 1,
        "train": {"model": {"n_layer": 2, "d_model": 64}, "steps": 100},
    }
    return json.dumps(body).encode()


def broker_messages(url: str) -> int:
    """Messages waiting on the queue's list(s) (kombu may add priority-suffixed lists)."""
    client = redis.Redis.from_url(url)
    try:
        keys = [k for k in client.scan_iter(match=f"{QUEUE}*") if client.type(k) == b"list"]
        return sum(int(client.llen(k)) for k in keys)
    finally:
        client.close()


def sql_counts(pg_url: str) -> tuple[int, int]:
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            jobs = conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()
            sent = conn.execute(
                sa.text("SELECT count(*) FROM attempts WHERE sent_at IS NOT NULL")
            ).scalar_one()
        return int(jobs), int(sent)
    finally:
        engine.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--total", type=int, default=6000, help="POSTs to send (upper bound)")
    p.add_argument("--max-s", type=float, default=30.0, help="stop sending after this long")
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)

    with stack() as s:
        spec_probe = json.loads(spec(0))
        if not (s.tmp / "data" / "tiny").is_dir():
            raise SystemExit("data root missing the default dataset folder")
        api = s.serve_api(args.workers, **api_env)
        headers = {**s.auth, "Content-Type": "application/json"}
        # Warm-up (Celery's lazy import and broker connection, pools), not counted: its jobs
        # are subtracted from the SQL and broker counts below.
        warm = post_load(api.url, "/v1/jobs", spec, headers, connections=4, total=200, max_s=20)
        if warm.ok() != 200:
            raise SystemExit(f"warm-up failed: {warm.statuses} failures={warm.failures}")
        cpu0 = api.cpu_s()
        result = post_load(
            api.url,
            "/v1/jobs",
            spec,
            headers,
            connections=args.connections,
            total=args.total,
            max_s=args.max_s,
        )
        cpu = api.cpu_s() - cpu0
        # The reconciler re-sends committed-but-unsent attempts after unsent_grace_s (5 s).
        deadline = time.monotonic() + 15
        while True:
            jobs, sent = sql_counts(s.pg_url)
            messages = broker_messages(s.broker_url)
            if (sent == jobs and messages == jobs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)

    ok = result.ok()
    jobs -= warm.ok()
    sent -= warm.ok()
    messages -= warm.ok()
    rate = ok / result.elapsed_s
    lat = percentiles(result.latencies)
    print(
        f"\nPOST /v1/jobs: uvicorn --workers {args.workers}, asyncio keep-alive client,"
        f" {args.connections} connections, {result.sent} requests in {result.elapsed_s:.1f}s;"
        f" service settings {api_env or 'defaults'}"
    )
    print(SHARED_CORES_NOTE)
    print(f"spec: {spec_probe}")
    print(
        f"responses by status: {dict(sorted(result.statuses.items()))};"
        f" no response: {result.failures}"
    )
    print(
        f"jobs/s (2xx / elapsed): {rate:.0f}   latency ms p50 {lat['p50']:.1f}"
        f" p90 {lat['p90']:.1f} p99 {lat['p99']:.1f} max {lat['max']:.1f}"
        f"   API CPU {1000 * cpu / max(1, result.sent):.2f} ms/request"
    )
    print(
        f"2xx responses {ok} | jobs rows {jobs} | attempts sent {sent} | broker messages {messages}"
    )
    none_lost = ok == jobs == sent == messages and result.failures == 0
    print(f"goal >= 500 jobs/s: {verdict(rate >= 500)}; none lost: {verdict(none_lost)}")


if __name__ == "__main__":
    main()
