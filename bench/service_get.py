"""GET /v1/jobs/{id} on PostgreSQL against a bare FastAPI endpoint returning a constant.

    .venv/bin/python bench/service_get.py [--workers 1] [--connections 32] [--duration 8]
                                          [--rounds 2] [--state running|queued|both]

One run stands up the service (fresh PostgreSQL, claimed Redis numbers, a non-admin token,
uvicorn ``service.api.app:create_app`` with its ingestor and reconciler) and ``bench/bare_app.py``
under the same uvicorn settings and worker count, then drives both with the same generator
(wrk, one thread, keep-alive, ``--connections``), alternating A B / B A. The job read is made
as a real one is: submitted through the API, then a worker's ``running`` lifecycle event and
a trainer's metric event XADDed to Redis, which the ingestor applies (so the response carries
an attempt with its host and the latest metrics). ``--state queued`` reads a queued job whose
queue a (registered) worker serves, the path that also counts the queue position.

Goals (issue 3): service/bare requests/s >= 0.6x; service p99 <= 25 ms at 32 connections.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import redis
from _load import wrk
from _util import (
    REPO,
    SHARED_CORES_NOTE,
    Server,
    Stack,
    alternate,
    base_env,
    median,
    serve,
    stack,
    verdict,
)

from trainer.events import Event, Keys

SPEC = {"name": "bench-get", "labels": {"team": "bench"}, "queue": "bench", "train": {}}


def xadd(client: redis.Redis, keys: Keys, event: Event) -> None:
    """As the worker's and trainer's Publisher does: both streams in one MULTI."""
    fields = event.to_fields()
    pipe = client.pipeline(transaction=True)
    pipe.xadd(keys.events, fields, maxlen=1_000_000, approximate=True)  # type: ignore[arg-type]
    pipe.xadd(keys.job(event.job_id), fields, maxlen=10_000, approximate=True)  # type: ignore[arg-type]
    pipe.execute()


def register_worker(client: redis.Redis, keys: Keys, queue: str) -> None:
    info = {
        "name": "bench-w",
        "host": "bench",
        "queues": [queue],
        "slots": 1,
        "gpus": 0,
        "running": [],
        "ts": time.time(),
    }
    client.hset(keys.workers, "bench-w", json.dumps(info))


def make_jobs(s: Stack, api_url: str) -> dict[str, str]:
    """A running job (attempt host, latest metrics) and a queued one; their ids."""
    keys = Keys("trainq")
    rc = redis.Redis.from_url(s.redis_url)
    with httpx.Client(base_url=api_url, headers=s.auth, timeout=10) as c:
        running = c.post("/v1/jobs", json=SPEC).raise_for_status().json()["id"]
        queued = c.post("/v1/jobs", json=SPEC).raise_for_status().json()["id"]
        # The worker's heartbeat (refreshed every hb_ttl/3 by a worker; one long TTL here),
        # or the reconciler declares the attempt lost and the job fails mid-benchmark.
        rc.set(keys.heartbeat(running, 1), "1", ex=3600)
        data = {"phase": "running", "host": "bench-host", "worker": "bench-w", "pid": 4242}
        xadd(rc, keys, Event("lifecycle", running, 1, "worker", 1, data))
        metric = {
            "step": 10,
            "steps": 1000,
            "time": time.time(),
            "loss": 4.2,
            "lr": 3e-4,
            "grad_norm": 1.0,
            "tokens_per_s": 1.2e5,
            "tokens_per_s_per_device": 6e4,
            "step_time_s": 0.1,
            "tflops": None,
            "mfu": None,
            "mem_peak_bytes": 1 << 30,
            "data_wait_frac": 0.01,
        }
        xadd(rc, keys, Event("metric", running, 1, "trainer", 1, metric))
        deadline = time.monotonic() + 30
        while True:
            job = c.get(f"/v1/jobs/{running}").json()
            if job["status"] == "running" and job.get("latest"):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the ingestor did not apply the events in 30s: {job}")
            time.sleep(0.2)
        register_worker(rc, keys, "bench")
        pending = c.get(f"/v1/jobs/{queued}").json()["pending_reason"]
        time.sleep(6)  # past heartbeat_grace_s: the job must still be running
        status = c.get(f"/v1/jobs/{running}").json()["status"]
        if status != "running":
            raise SystemExit(f"the running job became {status!r}")
        print(f"running job {running}: {len(json.dumps(job))} bytes of JSON")
        print(f"queued job {queued}: pending_reason {pending!r}")
    rc.close()
    return {"running": running, "queued": queued}


def with_cpu(server: Server, run: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The run's figures plus the server's CPU ms per request and cores used (its own
    processes only: on a shared machine this is the fair comparison)."""
    c0, t0 = server.cpu_s(), time.monotonic()
    r = run()
    r["cpu_ms"] = 1000 * (server.cpu_s() - c0) / max(1, r["requests"])
    r["cores"] = (server.cpu_s() - c0) / (time.monotonic() - t0)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers, both servers")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated")
    p.add_argument("--state", choices=("running", "queued", "both"), default="both")
    p.add_argument(
        "--api-env",
        action="append",
        default=[],
        metavar="TRAINQ_X=V",
        help="extra setting for the service (repeatable), e.g. TRAINQ_DB_POOL_SIZE=40",
    )
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)

    with stack() as s:
        api = s.serve_api(args.workers, **api_env)
        bare = serve(
            "bench.bare_app:app",
            env=base_env(REPO),
            workers=args.workers,
            log_dir=s.tmp,
            ready_path="/v1/const",
            name="bare",
        )
        s.servers.append(bare)
        jobs = make_jobs(s, api.url)
        rc = redis.Redis.from_url(s.redis_url)
        states = ["running", "queued"] if args.state == "both" else [args.state]

        def run_service(state: str) -> dict[str, float]:
            register_worker(rc, Keys("trainq"), "bench")  # stays live (15 s) for the run
            url = f"{api.url}/v1/jobs/{jobs[state]}"
            return with_cpu(
                api,
                lambda: wrk(
                    url,
                    connections=args.connections,
                    duration_s=args.duration,
                    headers=s.auth,
                    tmp=s.tmp,
                ),
            )

        def run_bare() -> dict[str, float]:
            return with_cpu(
                bare,
                lambda: wrk(
                    f"{bare.url}/v1/const",
                    connections=args.connections,
                    duration_s=args.duration,
                    tmp=s.tmp,
                ),
            )

        # Warm both (connection pools, token cache, JIT-less but lazy imports) before timing.
        run_bare()
        run_service(states[0])
        sides: dict[str, Callable[[], Any]] = {
            f"service[{st}]": functools.partial(run_service, st) for st in states
        }
        sides["bare"] = run_bare
        results = alternate(args.rounds, sides)
        rc.close()

    print(
        f"\nGET /v1/jobs/{{id}} vs bare FastAPI constant: uvicorn --workers {args.workers},"
        f" wrk -t1 -c{args.connections} -d{args.duration:.0f}s, {args.rounds} runs each,"
        f" alternated; service settings {api_env or 'defaults'}"
    )
    print(SHARED_CORES_NOTE)
    print(
        f"{'side':<20} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
        f" {'errors':>7} {'cpu ms/req':>10} {'api cores':>9}   per run req/s"
    )
    med: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        m = {
            k: median([r[k] for r in runs])
            for k in ("rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "cpu_ms", "cores")
        }
        m["errors"] = sum(r["errors"] for r in runs)
        med[name] = m
        per_run = " ".join(f"{r['rps']:.0f}" for r in runs)
        print(
            f"{name:<20} {m['rps']:>9.0f} {m['p50_ms']:>8.2f} {m['p90_ms']:>8.2f}"
            f" {m['p99_ms']:>8.2f} {m['max_ms']:>8.1f} {m['errors']:>7.0f} {m['cpu_ms']:>10.2f}"
            f" {m['cores']:>9.2f}   {per_run}"
        )
    for st in states:
        m = med[f"service[{st}]"]
        ratio = m["rps"] / med["bare"]["rps"]
        print(
            f"service[{st}] / bare requests/s: {ratio:.2f}x (goal >= 0.6x: "
            f"{verdict(ratio >= 0.6)}); p99 {m['p99_ms']:.1f} ms (goal <= 25 ms: "
            f"{verdict(m['p99_ms'] <= 25)}); CPU per request "
            f"{m['cpu_ms'] / med['bare']['cpu_ms']:.1f}x the bare one's"
        )


if __name__ == "__main__":
    main()
