"""/healthz while one owner opens many more SSE streams than its cap: latency against idle.

    .venv/bin/python bench/sse_refused.py [--streams 500] [--cap 32] [--probes 40]
                                          [--compare-tree /tmp/trainq-before] [--fresh-probes]

Stands up the service (fresh PostgreSQL, claimed Redis numbers, uvicorn
``service.api.app:create_app``, auth on), submits one job, and measures ``GET /healthz``
sequentially at idle. Then three bursts of ``--streams`` connections at once (raw asyncio
HTTP/1.1, one process), each while a client in another thread probes ``/healthz`` every
20 ms: plain ``GET /healthz`` (the floor: what any burst of new connections costs this
process); one owner's ``GET /v1/jobs/{id}/events`` (``--cap`` =
``TRAINQ_SSE_MAX_STREAMS_PER_OWNER`` of them admitted, the rest refused with a 429); and the
same with the cap's streams opened beforehand, so that every one of the burst is refused.
Prints the probe latencies at idle and during each burst, how the GETs were answered, and
the API's CPU time per GET and thread count (a refusal that hops to the thread pool shows
in both). With ``--compare-tree``, a second API is served from that copy of the repository
(say the commit before, from ``git archive``) and measured the same way, after the first.

Goal (issue 22): /healthz under 1 s while the streams are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _util import SHARED_CORES_NOTE, percentiles, stack, verdict


async def open_get(
    port: int, path: str, token: str, hold: asyncio.Event, opened: list[int] | None = None
) -> int:
    """One GET of ``path`` on a new connection; the status, or 0 on a connection error. An
    accepted event stream is noted in ``opened`` and held open until ``hold`` is set."""
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
            if opened is not None:
                opened.append(status)
            await hold.wait()
        return status
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        return 0
    finally:
        writer.close()


def probe(url: str, until: threading.Event, fresh: bool, every: float = 0.02) -> list[float]:
    """/healthz latencies (s), one request at a time, until ``until`` is set; ``fresh``: each
    on a new connection (as a kubelet probes), so waiting to be accepted counts too. Run in a
    thread of its own, so the burst's event loop does not delay the probe's reads."""
    out: list[float] = []
    keep = httpx.Limits(max_keepalive_connections=0 if fresh else None)
    with httpx.Client(base_url=url, timeout=30, limits=keep) as c:
        while not until.is_set():
            t = time.perf_counter()
            r = c.get("/healthz")
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.status_code
            until.wait(every)
    return out


async def burst(
    port: int,
    url: str,
    path: str,
    token: str,
    count: int,
    held: int,
    before: int,
    cpu_s: Callable[[], float],
    fresh: bool,
) -> tuple[list[float], dict[int, int], float, float]:
    """``count`` GETs of ``path`` at once while /healthz is probed; ``held`` of them are
    accepted streams (held open until the others have their answers). ``before`` streams
    are opened (and held) first, unprobed and uncounted. Also the API's CPU seconds (by
    ``cpu_s``) from the burst's start until the others have their answers."""
    hold, answered = asyncio.Event(), threading.Event()
    opened: list[int] = []
    first = [asyncio.create_task(open_get(port, path, token, hold, opened)) for _ in range(before)]
    deadline = time.monotonic() + 60
    while len(opened) < before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if len(opened) < before:
        raise SystemExit(f"only {len(opened)} of {before} streams opened before the burst")
    latencies: list[float] = []
    cpu0 = cpu_s()
    prober = threading.Thread(target=lambda: latencies.extend(probe(url, answered, fresh)))
    prober.start()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(open_get(port, path, token, hold)) for _ in range(count)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(t.done() for t in tasks) < count - held:
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    cpu = cpu_s() - cpu0
    answered.set()
    hold.set()
    prober.join()
    codes: dict[int, int] = {}
    for status in await asyncio.gather(*tasks):
        codes[status] = codes.get(status, 0) + 1
    await asyncio.gather(*first)
    return latencies, codes, took, cpu


def _threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("Threads:")), 0)  # fmt: skip


Run = tuple[list[float], dict[int, int], float, float, int]


def measure(s: Any, api: Any, args: argparse.Namespace) -> tuple[list[float], dict[str, Run]]:
    """Idle /healthz probes, then the three bursts, against one API."""
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
    events = f"/v1/jobs/{job_id}/events"
    runs = {}
    for name, path, held, before in (
        ("plain", "/healthz", 0, 0),
        ("streams", events, args.cap, 0),
        ("refused", events, 0, args.cap),
    ):
        time.sleep(1.0)  # the previous burst's streams and connections are gone
        busy, codes, took, cpu = asyncio.run(
            burst(port, api.url, path, s.token, args.streams, held, before, api.cpu_s, args.fresh)
        )
        threads = sum(_threads(pid) for pid in api.pids())
        runs[name] = (busy, codes, took, cpu, threads)
    return idle, runs


def report(title: str, idle: list[float], runs: dict[str, Run], streams: int) -> float:
    """Print one API's figures; its /healthz max (ms) while every GET of a burst is refused."""
    a = percentiles(idle)
    print(title)
    print(f"/healthz idle ms:    p50 {a['p50']:.1f}  p99 {a['p99']:.1f}  max {a['max']:.1f}")
    for name, (busy, codes, took, cpu, threads) in runs.items():
        b = percentiles(busy)
        print(
            f"burst of {name + ':':8} answered {dict(sorted(codes.items()))} in {took:.1f}s;"
            f" API CPU {1000 * cpu / streams:.2f} ms a request; API threads {threads}"
        )
        print(
            f"  /healthz meanwhile ms: p50 {b['p50']:.1f}  p99 {b['p99']:.1f}  max {b['max']:.1f}"
            f"  ({len(busy)} probes)"
        )
    plain = percentiles(runs["plain"][0])["max"]
    for name in ("streams", "refused"):
        busy_max = percentiles(runs[name][0])["max"]
        cpu_ratio = runs[name][3] / max(runs["plain"][3], 1e-6)
        print(
            f"{name}/plain: /healthz max {busy_max / max(plain, 1e-6):.1f}x,"
            f" API CPU {cpu_ratio:.1f}x"
        )
    return max(percentiles(runs[k][0])["max"] for k in ("streams", "refused"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--cap", type=int, default=32, help="TRAINQ_SSE_MAX_STREAMS_PER_OWNER")
    p.add_argument("--probes", type=int, default=40, help="idle /healthz probes")
    p.add_argument("--show-log", type=int, default=0, metavar="N", help="print the API log's tail")
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    p.add_argument("--compare-tree", type=Path, default=None, help="a copy of the repo")
    p.add_argument(
        "--fresh-probes", dest="fresh", action="store_true", help="probe on new connections"
    )
    args = p.parse_args()
    env = {"TRAINQ_SSE_MAX_STREAMS_PER_OWNER": str(args.cap)}
    env.update(kv.split("=", 1) for kv in args.api_env)

    results = {}
    with stack() as s:
        api = s.serve_api(1, **env)
        results["this tree"] = measure(s, api, args)
        if args.show_log:
            print(api.tail(args.show_log))
        if args.compare_tree:
            api.stop()
            copy = s.serve_api(1, tree=args.compare_tree.resolve(), **env)
            results[f"copy {args.compare_tree}"] = measure(s, copy, args)

    print(
        f"\n/healthz while {args.streams} GETs arrive at once: plain /healthz; one owner's SSE"
        f" streams (cap {args.cap}, the rest refused); the same once the cap's are open (all"
        " refused); uvicorn --workers 1; /healthz probed on"
        f" {'a new connection each' if args.fresh else 'one kept-alive connection'}"
    )
    print(SHARED_CORES_NOTE)
    worst = {name: report(name, *got, args.streams) for name, got in results.items()}
    if args.compare_tree:
        here, there = worst.values()
        print(f"this tree/copy: /healthz max while refusing {here / max(there, 1e-6):.2f}x")
    print(f"goal /healthz max < 1000 ms while refusing: {verdict(worst['this tree'] < 1000)}")


if __name__ == "__main__":
    main()
