"""An event XADDed to Redis reaching 200 concurrent SSE followers: latency percentiles.

    .venv/bin/python bench/service_sse.py [--followers 200] [--jobs 1] [--events 60]
                                          [--interval 0.1] [--workers 1]

Stands up the service (fresh PostgreSQL, claimed Redis numbers, uvicorn
``service.api.app:create_app`` with its ingestor), submits ``--jobs`` jobs and marks each running
with a worker's lifecycle event, then opens ``--followers`` connections to
``GET /v1/jobs/{id}/events`` spread round-robin over the jobs (raw asyncio HTTP/1.1, uvloop,
one process). Once every follower has its response headers, it XADDs ``--events`` metric
events per job, as the trainer's Publisher does (``Event.to_fields``, one MULTI to
``trainq:events`` and ``trainq:job:{id}``), each carrying its send time (``time.time()`` taken
just before the MULTI) in ``data.time``, ``--interval`` seconds apart. Each follower stamps
every read as it returns and matches the events in it; latency = receive stamp - send time.

The followers and the publisher share one event loop in this process, so a follower's stamp
includes the wait behind the other followers' reads of the same event (client-side cost,
which a real client spread over machines would not pay): the figures are an upper bound.

Goals (issue 3): p50 <= 15 ms, p99 <= 100 ms with 200 concurrent followers.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import redis
import redis.asyncio
from _util import SHARED_CORES_NOTE, percentiles, stack, verdict

from trainer.events import Event, Keys

MARK = re.compile(rb'"bench_job":"([0-9a-f]+)","bench_step":(\d+),"time":([0-9.e+-]+)')


class Follower:
    def __init__(self, port: int, job_id: str, token: str) -> None:
        self.port = port
        self.job_id = job_id
        self.token = token
        self.ready = asyncio.Event()
        self.status = 0
        self.samples: list[tuple[int, float]] = []  # (step, latency s)
        self.error: str | None = None

    async def run(self, stop: asyncio.Event, sent: dict[tuple[str, int], float]) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as exc:
            self.error = f"connect: {exc}"
            self.ready.set()
            return
        writer.write(
            (
                f"GET /v1/jobs/{self.job_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {self.token}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        buf = b""
        pos = 0
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            self.status = int(head.split(b" ", 2)[1])
            self.ready.set()
            if self.status != 200:
                detail = await asyncio.wait_for(reader.read(300), 5)
                self.error = f"status {self.status}: {detail.decode(errors='replace')[-120:]}"
                return
            while not stop.is_set():
                try:
                    data = await asyncio.wait_for(reader.read(65536), 0.5)
                except TimeoutError:
                    continue
                now = time.time()
                if not data:
                    self.error = "stream closed"
                    return
                buf += data
                for m in MARK.finditer(buf, pos):
                    self.samples.append((int(m.group(2)), now - float(m.group(3))))
                    pos = m.end()
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.ready.set()
        finally:
            writer.close()


async def publish(url: str, job_ids: list[str], events: int, interval: float) -> None:
    """Metric events as the trainer's rank 0 sends them; the send time is in the data."""
    keys = Keys("trainq")
    client = redis.asyncio.Redis.from_url(url)
    try:
        for step in range(1, events + 1):
            for job_id in job_ids:
                t = time.time()
                data = {
                    "bench_job": job_id,
                    "bench_step": step,
                    "time": t,
                    "step": step,
                    "steps": events,
                    "loss": 3.0,
                    "lr": 3e-4,
                    "grad_norm": 1.0,
                    "tokens_per_s": 1e5,
                    "tokens_per_s_per_device": 5e4,
                    "step_time_s": 0.1,
                    "tflops": None,
                    "mfu": None,
                    "mem_peak_bytes": 1 << 30,
                    "data_wait_frac": 0.0,
                }
                fields: Any = Event("metric", job_id, 1, "trainer", 1000 + step, data, ts=t)
                fields = fields.to_fields()
                pipe = client.pipeline(transaction=True)
                pipe.xadd(keys.events, fields, maxlen=1_000_000, approximate=True)
                pipe.xadd(keys.job(job_id), fields, maxlen=10_000, approximate=True)
                await pipe.execute()
            await asyncio.sleep(interval)
    finally:
        await client.aclose()


async def drive(
    port: int, redis_url: str, token: str, job_ids: list[str], args: argparse.Namespace
) -> tuple[list[Follower], float]:
    followers = [Follower(port, job_ids[i % len(job_ids)], token) for i in range(args.followers)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(f.run(stop, {})) for f in followers]
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(f.ready.wait() for f in followers)), 60)
    connect_s = time.monotonic() - t0
    await asyncio.sleep(1.0)  # every follower is in its XREAD BLOCK
    await publish(redis_url, job_ids, args.events, args.interval)
    await asyncio.sleep(1.0)  # the last event's stragglers
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return followers, connect_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--followers", type=int, default=200)
    p.add_argument("--jobs", type=int, default=1, help="jobs the followers are spread over")
    p.add_argument("--events", type=int, default=60, help="events per job")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between events")
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers")
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    p.add_argument(
        "--redis-max-connections",
        type=int,
        default=0,
        metavar="N",
        help="append ?max_connections=N to the service's TRAINQ_REDIS_URL (redis-py's"
        " asyncio pool allows 100 by default, and each follower holds one)",
    )
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)

    with stack() as s:
        if args.redis_max_connections:
            api_env["TRAINQ_REDIS_URL"] = (
                f"{s.redis_url}?max_connections={args.redis_max_connections}"
            )
        api = s.serve_api(args.workers, **api_env)
        keys = Keys("trainq")
        rc = redis.Redis.from_url(s.redis_url)
        job_ids = []
        with httpx.Client(base_url=api.url, headers=s.auth, timeout=10) as c:
            for _ in range(args.jobs):
                spec = {"name": "bench-sse", "queue": "bench", "train": {}}
                job_id = c.post("/v1/jobs", json=spec).raise_for_status().json()["id"]
                running = {"phase": "running", "host": "h", "worker": "w", "pid": 1}
                fields: Any = Event("lifecycle", job_id, 1, "worker", 1, running).to_fields()
                # The worker's heartbeat (it refreshes every hb_ttl/3; one long TTL here),
                # or the reconciler declares the attempt lost and the streams end.
                rc.set(keys.heartbeat(job_id, 1), "1", ex=3600)
                rc.xadd(keys.events, fields)
                rc.xadd(keys.job(job_id), fields)
                job_ids.append(job_id)
            deadline = time.monotonic() + 30
            while any(c.get(f"/v1/jobs/{j}").json()["status"] != "running" for j in job_ids):
                if time.monotonic() > deadline:
                    raise SystemExit("the ingestor did not mark the jobs running in 30s")
                time.sleep(0.2)
        rc.close()
        port = int(api.url.rsplit(":", 1)[1])
        cpu0 = api.cpu_s()
        try:
            import uvloop

            followers, connect_s = uvloop.run(drive(port, s.redis_url, s.token, job_ids, args))
        except ImportError:
            followers, connect_s = asyncio.run(drive(port, s.redis_url, s.token, job_ids, args))
        api_cpu = api.cpu_s() - cpu0

    latencies = [lat for f in followers for _, lat in f.samples]
    counts: dict[int, int] = {}
    for f in followers:
        counts[len(f.samples)] = counts.get(len(f.samples), 0) + 1
    if len(counts) > 1:
        print(f"followers by events received: {dict(sorted(counts.items()))}")
    expected = args.followers * args.events
    errors: dict[str, int] = {}
    for f in followers:
        if f.error:
            errors[f.error] = errors.get(f.error, 0) + 1
    lat = percentiles(latencies)
    print(
        f"\nSSE: {args.followers} followers over {args.jobs} job(s), {args.events} events per"
        f" job {args.interval * 1000:.0f} ms apart; uvicorn --workers {args.workers};"
        f" followers connected in {connect_s:.1f}s; service settings {api_env or 'defaults'}"
    )
    print(SHARED_CORES_NOTE + "; followers and publisher share one event loop (upper bound)")
    print(
        f"received {len(latencies)} of {expected} (follower, event) pairs;"
        f" follower errors: {errors or 'none'}"
    )
    print(
        f"XADD -> received ms: p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}"
        f"  max {lat['max']:.1f}"
    )
    print(
        f"API CPU {api_cpu:.1f}s for the connects and deliveries:"
        f" {1000 * api_cpu / max(1, len(latencies)):.2f} ms per (follower, event) delivered"
    )
    complete = len(latencies) == expected
    print(
        f"goal p50 <= 15 ms: {verdict(lat['p50'] <= 15)}; p99 <= 100 ms:"
        f" {verdict(lat['p99'] <= 100)}; every event reached every follower:"
        f" {verdict(complete)}"
    )


if __name__ == "__main__":
    main()
