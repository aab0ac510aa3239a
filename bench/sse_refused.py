"""/healthz while one owner opens many more SSE streams than its cap: latency against idle.

    .venv/bin/python bench/sse_refused.py [--streams 500] [--cap 32] [--probes 40]

Stands up the service (fresh PostgreSQL, claimed Redis numbers, uvicorn
``service.api.app:create_app``, auth on), submits one job, and measures ``GET /healthz``
sequentially at idle. Then one owner opens ``--streams`` connections to
``GET /v1/jobs/{id}/events`` at once (raw asyncio HTTP/1.1, one process); past
``TRAINQ_SSE_MAX_STREAMS_PER_OWNER`` (``--cap``) they are refused with a 429. While they
arrive, a client in another thread probes ``/healthz`` every 20 ms. Prints the probe
latencies at idle and during the burst, their ratio, how the streams were answered, and the
API's CPU seconds and thread count (a refusal that hops to the thread pool shows in both).

Goal (issue 22): /healthz under 1 s while the streams are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _util import SHARED_CORES_NOTE, percentiles, stack, verdict


async def open_get(port: int, path: str, token: str, hold: asyncio.Event) -> int:
    """One GET of ``path`` on a new connection; the status, or 0 on a connection error. An
    accepted event stream is held open until ``hold`` is set."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0
    try:
        writer.write(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        status = int(head.split(b" ", 2)[1])
        if status == 200 and b"text/event-stream" in head:
            await hold.wait()
        return status
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        return 0
    finally:
        writer.close()


def probe(url: str, until: threading.Event, every: float = 0.02) -> list[float]:
    """/healthz latencies (s), one request at a time, until ``until`` is set. Run in a
    thread of its own, so the burst's event loop does not delay the probe's reads."""
    out: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while not until.is_set():
            t = time.perf_counter()
            r = c.get("/healthz")
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.status_code
            until.wait(every)
    return out


async def burst(
    port: int, url: str, path: str, token: str, count: int, held: int
) -> tuple[list[float], dict[int, int], float]:
    """``count`` GETs of ``path`` at once while /healthz is probed; ``held`` of them are
    accepted streams (held open until the others have their answers)."""
    hold, answered = asyncio.Event(), threading.Event()
    latencies: list[float] = []
    prober = threading.Thread(target=lambda: latencies.extend(probe(url, answered)))
    prober.start()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(open_get(port, path, token, hold)) for _ in range(count)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(t.done() for t in tasks) < count - held:
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    answered.set()
    hold.set()
    prober.join()
    codes: dict[int, int] = {}
    for status in await asyncio.gather(*tasks):
        codes[status] = codes.get(status, 0) + 1
    return latencies, codes, took


def _threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("Threads:")), 0)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--cap", type=int, default=32, help="TRAINQ_SSE_MAX_STREAMS_PER_OWNER")
    p.add_argument("--probes", type=int, default=40, help="idle /healthz probes")
    p.add_argument("--show-log", type=int, default=0, metavar="N", help="print the API log's tail")
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)

    with stack() as s:
        api = s.serve_api(1, **{"TRAINQ_SSE_MAX_STREAMS_PER_OWNER": str(args.cap), **api_env})
        with httpx.Client(base_url=api.url, headers=s.auth, timeout=10) as c:
            spec = {"name": "bench-refused", "queue": "bench", "train": {}}
            job_id = c.post("/v1/jobs", json=spec).raise_for_status().json()["id"]
            idle = []
            for _ in range(args.probes):
                t = time.perf_counter()
                c.get("/healthz").raise_for_status()
                idle.append(time.perf_counter() - t)
                time.sleep(0.02)
        port = int(api.url.rsplit(":", 1)[1])
        runs = {}
        # Side by side: the same number of plain /healthz GETs at once (what any burst of
        # new connections costs this process), then the streams (the refusals).
        for name, path, held in (
            ("plain", "/healthz", 0),
            ("streams", f"/v1/jobs/{job_id}/events", args.cap),
        ):
            cpu0 = api.cpu_s()
            busy, codes, took = asyncio.run(burst(port, api.url, path, s.token, args.streams, held))
            threads = sum(_threads(pid) for pid in api.pids())
            runs[name] = (busy, codes, took, api.cpu_s() - cpu0, threads)
            time.sleep(1.0)
        if args.show_log:
            print(api.tail(args.show_log))

    a = percentiles(idle)
    print(
        f"\n/healthz while {args.streams} GETs arrive at once: plain /healthz, then one owner's"
        f" SSE streams (cap {args.cap}, the rest refused); uvicorn --workers 1"
    )
    print(SHARED_CORES_NOTE)
    print(f"/healthz idle ms:    p50 {a['p50']:.1f}  p99 {a['p99']:.1f}  max {a['max']:.1f}")
    for name, (busy, codes, took, cpu, threads) in runs.items():
        b = percentiles(busy)
        print(
            f"burst of {name + ':':8} answered {dict(sorted(codes.items()))} in {took:.1f}s;"
            f" API CPU {1000 * cpu / args.streams:.2f} ms a request; API threads {threads}"
        )
        print(
            f"  /healthz meanwhile ms: p50 {b['p50']:.1f}  p99 {b['p99']:.1f}  max {b['max']:.1f}"
            f"  ({len(busy)} probes)"
        )
    plain, streams = (percentiles(runs[k][0]) for k in ("plain", "streams"))
    cpu_ratio = runs["streams"][3] / max(runs["plain"][3], 1e-6)
    print(
        f"streams/plain: /healthz max {streams['max'] / max(plain['max'], 1e-6):.1f}x,"
        f" API CPU {cpu_ratio:.1f}x"
    )
    print(f"goal /healthz max < 1000 ms while refusing: {verdict(streams['max'] < 1000)}")


if __name__ == "__main__":
    main()
