"""Webhook deliveries per second to a local receiver, and what delivering costs GET /v1/jobs/{id}.

    .venv/bin/python bench/webhooks.py [--events 10000] [--rounds 3] [--quiet-s 6]
        [--mode thread|process|pinned|paced|both|all] [--pace 600] [--api-env TRAINQ_X=V]

One run stands up the service (fresh PostgreSQL, claimed Redis numbers, uvicorn with one
worker), a receiver in a process of its own (``http.server``, HTTP/1.1 keep-alive, counting;
the first 50 deliveries verified with ``standardwebhooks``), one endpoint of the bench's
owner, and a running job to read. Then, alternated (quiet, busy, quiet, ... quiet: ``--rounds``
busy windows, each between two quiet ones):

- quiet: GET /v1/jobs/{id} one request after another for ``--quiet-s`` with nothing to
  deliver (the deliverer idle, polling);
- busy: ``--events`` events are committed at once (as 1,000 jobs' status changes, 10 each),
  and the same GET loop runs while the deliverer fans them out and sends them; deliveries/s
  is events / (commit -> the receiver has every one).

``--mode thread``: the deliverer is the API's own thread (``TRAINQ_WEBHOOK_DELIVER=true``);
``process``: ``python -m service.api.webhooks.delivery`` beside an API with it off. Both print
side by side. ``pinned`` is ``process`` with the machine split as separate hosts would split
it: the API and the GET loop on CPU 0, the deliverer and the receiver on CPU 1 (affinity of
every thread; PostgreSQL and Redis, not ours, stay on both). It asks whether delivering slows
the API by more than taking its CPU: locks, the database, the API's own event loop.
``paced`` is ``process`` with ``TRAINQ_WEBHOOK_MAX_PER_S`` at ``--pace`` (600): the backlog
drains at that pace, its CPU and database work spread over the window instead of at once.
Each busy window's GET p50 (and mean) is divided by the mean of the two quiet
windows around it, so drift in the shared machine's load hits both sides of a ratio alike;
the figure judged is the median of those ratios. The CPU each process used is printed too.

Goals (issue 27): >= 500 deliveries/s; busy/quiet GET latency <= 1.10x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import sqlalchemy as sa
from _util import SHARED_CORES_NOTE, Server, Stack, cpu_seconds, free_port, median, stack
from _util import percentiles as pct
from _util import verdict as said

# The receiver stands in for another host: it is part of the bench, not of trainq, and its
# CPU is taken from the same 2 shared cores as the API's. So it is as cheap as an HTTP/1.1
# keep-alive server can be in Python (asyncio, the request line and Content-Length parsed by
# hand, one write per answer), not http.server (a thread and a header parser per request).
RECEIVER = r"""
import asyncio, re, sys
from standardwebhooks import Webhook
secret = sys.argv[2]
count = 0
bad = 0
NO_CONTENT = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"
LENGTH = re.compile(rb"(?i)\r\ncontent-length:[ \t]*([0-9]+)")
class Conn(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""
    def data_received(self, data):
        global count, bad
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end]
            m = LENGTH.search(head)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + length:
                break
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            if head.startswith(b"GET"):
                text = f"{count} {bad}".encode()
                out.append(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
                continue
            count += 1
            if count <= 50:
                lines = [line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:]]
                headers = {k.strip().lower(): v.strip() for k, _, v in lines}
                try:
                    Webhook(secret).verify(body, headers)
                except Exception:
                    bad += 1
            out.append(NO_CONTENT)
        if out:
            self.transport.write(b"".join(out))
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Conn, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""

EVENTS_SQL = """
INSERT INTO events (owner, type, job_id, data, created_at)
SELECT :owner, 'job.' || (ARRAY['queued','running','succeeded'])[1 + (n / 1000) % 3],
       'bench' || lpad((n % 1000)::text, 6, '0'),
       json_build_object('job_id', 'bench' || lpad((n % 1000)::text, 6, '0'), 'n', n),
       now()
FROM generate_series(:start, :start + :count - 1) AS n
"""


def get_loop(url: str, headers: dict[str, str], stop: threading.Event) -> list[float]:
    """GET ``url`` one after another until ``stop``; each request's seconds."""
    times: list[float] = []
    with httpx.Client(headers=headers, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get(url)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return times


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (and the threads they start later) on ``cpus`` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def received(url: str) -> tuple[int, int]:
    count, bad = httpx.get(url, timeout=5).text.split()
    return int(count), int(bad)


def run_mode(s: Stack, mode: str, args: argparse.Namespace, api_env: dict[str, str]) -> Any:
    env = {
        "TRAINQ_WEBHOOK_ALLOW_LOOPBACK": "1",
        "TRAINQ_WEBHOOK_DELIVER": "true" if mode == "thread" else "false",
        **api_env,
    }
    if mode == "paced":
        env["TRAINQ_WEBHOOK_MAX_PER_S"] = f"{args.pace:g}"
    api = s.serve_api(1, **env)
    pinned = mode == "pinned"
    if pinned:  # the API and this process (its GET loop) on CPU 0; ours below on CPU 1
        for pid in (*api.pids(), os.getpid()):
            pin(pid, {0})
    deliverer: subprocess.Popen[bytes] | None = None
    receiver: subprocess.Popen[bytes] | None = None
    engine = sa.create_engine(s.pg_url)
    try:
        with httpx.Client(base_url=api.url, headers=s.auth, timeout=10) as c:
            job = c.post("/v1/jobs", json={"name": "b", "queue": "bench", "train": {}}).json()
            port = free_port()
            hook_url = f"http://127.0.0.1:{port}/hook"
            hook = c.post("/v1/webhooks", json={"url": hook_url, "events": ["job.*"]})
            assert hook.status_code == 201, hook.text
            hook_id, secret = hook.json()["id"], hook.json()["secret"]
        away = ["taskset", "-c", "1"] if pinned else []
        receiver = subprocess.Popen(
            [*away, sys.executable, "-c", RECEIVER, str(port), secret], start_new_session=True
        )
        count_url = f"http://127.0.0.1:{port}/count"
        for _ in range(100):
            try:
                received(count_url)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        if mode in ("process", "pinned", "paced"):
            with (s.tmp / "deliverer.log").open("wb") as log:
                deliverer = subprocess.Popen(
                    [*away, sys.executable, "-m", "service.api.webhooks.delivery"],
                    env=s.env(**env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        get_url = f"{api.url}/v1/jobs/{job['id']}"
        for _ in range(200):  # warm: connections, token cache
            httpx.get(get_url, headers=s.auth)
        pids = {"api": api, "deliverer": deliverer, "receiver": receiver}
        out: dict[str, list[Any]] = {"quiet": [], "busy": []}
        start = 0
        for r in range(args.rounds * 2 + 1):
            phase = "quiet" if r % 2 == 0 else "busy"
            out[phase].append(phase_run(s, phase, get_url, count_url, engine, start, args, pids))
            print(f"{mode} {phase}: {json.dumps(out[phase][-1])}", flush=True)
            if phase == "busy":
                start += args.events
        count, bad = received(count_url)
        with httpx.Client(base_url=api.url, headers=s.auth, timeout=10) as c:
            failures = c.get(f"/v1/webhooks/{hook_id}/deliveries", params={"status": "failed"})
            failed = len(failures.json()["items"])
            c.delete(f"/v1/webhooks/{hook_id}")  # the next mode's events are not for it
        return out, count, bad, failed
    finally:
        for p in (deliverer, receiver):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    print(f"pid {p.pid} did not stop in 30 s after SIGTERM: killed", flush=True)
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
        api.stop()
        s.servers.remove(api)
        engine.dispose()
        if pinned:
            pin(os.getpid(), set(range(os.cpu_count() or 1)))


def _cpu(procs: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        if isinstance(p, Server):
            out[name] = p.cpu_s()
        elif p is not None:
            out[name] = cpu_seconds([p.pid])
    return out


def _commits(engine: sa.Engine) -> int:
    """Transactions committed in the bench's own database so far (PostgreSQL's statistics,
    flushed within a second or so: a window's figure is close, not exact)."""
    time.sleep(1.0)  # let the backends flush their counts
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
                )
            ).scalar_one()
        )


def phase_run(
    s: Stack,
    phase: str,
    get_url: str,
    count_url: str,
    engine: sa.Engine,
    start: int,
    args: argparse.Namespace,
    procs: dict[str, Any],
) -> dict[str, Any]:
    stop = threading.Event()
    times: list[float] = []
    loop = threading.Thread(target=lambda: times.extend(get_loop(get_url, s.auth, stop)))
    before, _ = received(count_url)
    commits0 = _commits(engine)
    cpu0, t0 = _cpu(procs), time.monotonic()
    loop.start()
    result: dict[str, Any] = {}
    if phase == "quiet":
        time.sleep(args.quiet_s)
    else:
        with engine.begin() as conn:
            conn.execute(
                sa.text(EVENTS_SQL), {"owner": s.owner, "start": start, "count": args.events}
            )
        committed = time.monotonic()
        deadline = committed + 600
        while received(count_url)[0] < before + args.events:
            if time.monotonic() > deadline:
                raise SystemExit("the receiver did not get every event in 600 s")
            time.sleep(0.05)
        result["per_s"] = args.events / (time.monotonic() - committed)
    stop.set()
    loop.join()
    wall = time.monotonic() - t0
    cpu1 = _cpu(procs)
    result["get"] = pct(times)
    result["get"]["mean"] = 1000 * sum(times) / max(1, len(times))
    result["cores"] = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0}
    result["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
    result["commits"] = _commits(engine) - commits0
    return result


def window_ratios(quiet: list[Any], busy: list[Any], key: str) -> list[float]:
    """Each busy window's GET figure over the mean of the quiet windows either side of it
    (busy window i lies between quiet windows i and i + 1)."""
    return [
        b["get"][key] / ((quiet[i]["get"][key] + quiet[i + 1]["get"][key]) / 2)
        for i, b in enumerate(busy)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument(
        "--mode", choices=("thread", "process", "pinned", "paced", "both", "all"), default="all"
    )
    p.add_argument("--pace", type=float, default=600.0, help="--mode paced: deliveries/s")
    p.add_argument("--rounds", type=int, default=3, help="busy windows per mode")
    p.add_argument("--quiet-s", type=float, default=6.0)
    p.add_argument("--api-env", action="append", default=[], metavar="TRAINQ_X=V")
    args = p.parse_args()
    api_env = dict(kv.split("=", 1) for kv in args.api_env)
    modes = {"both": ["thread", "process"], "all": ["thread", "process", "pinned", "paced"]}.get(
        args.mode, [args.mode]
    )
    if "pinned" in modes and (os.cpu_count() or 1) < 2:
        sys.exit("bench/webhooks.py: --mode pinned needs two CPUs")
    rows = {}
    with stack() as s:
        for mode in modes:
            rows[mode] = run_mode(s, mode, args, api_env)

    print(f"\nwebhooks: {args.events} events a busy phase, one endpoint, receiver on loopback")
    print(SHARED_CORES_NOTE)
    ok = True
    for mode, (out, count, bad, failed) in rows.items():
        quiet = out["quiet"]
        busy = out["busy"]
        rate = median([b["per_s"] for b in busy])
        q50 = median([q["get"]["p50"] for q in quiet])
        b50 = median([b["get"]["p50"] for b in busy])
        qmean = median([q["get"]["mean"] for q in quiet])
        bmean = median([b["get"]["mean"] for b in busy])
        r50, rmean = window_ratios(quiet, busy, "p50"), window_ratios(quiet, busy, "mean")
        ratio = median(r50)
        ok = ok and rate >= 500 and ratio <= 1.10
        print(
            f"{mode:8s} deliveries {rate:7.0f}/s ({said(rate >= 500)} >= 500)"
            f" | GET p50 quiet {q50:.2f} ms busy {b50:.2f} ms"
            f" | mean {qmean:.2f} -> {bmean:.2f} ms"
        )
        print(
            f"{'':8s} busy/quiet p50 per window {' '.join(f'{r:.2f}' for r in r50)}:"
            f" median {ratio:.2f}x ({said(ratio <= 1.10)} <= 1.10);"
            f" mean per window {' '.join(f'{r:.2f}' for r in rmean)}: median {median(rmean):.2f}x"
        )
        print(
            f"{'':8s} GET p99 quiet {median([q['get']['p99'] for q in quiet]):.2f} ms"
            f" busy {median([b['get']['p99'] for b in busy]):.2f} ms;"
            f" busy cores: "
            + ", ".join(f"{k} {v:.2f}" for k, v in busy[-1]["cores"].items())
            + f"; received {count}, bad signatures {bad}, failed {failed}"
        )
        # CPU seconds each process spent in a busy window, per delivery (the API's include
        # its GETs): what delivering costs, the figure the shared machine's load moves least
        per = {
            k: 1000 * median([b["cpu_s"][k] for b in busy]) / args.events for k in busy[-1]["cpu_s"]
        }
        print(f"{'':8s} CPU per delivery: " + ", ".join(f"{k} {v:.3f} ms" for k, v in per.items()))
        # the GETs commit too: the quiet windows' commits per GET, taken off the busy ones'
        per_get = median([q["commits"] / max(1, q["get"]["n"]) for q in quiet])
        own = median([(b["commits"] - per_get * b["get"]["n"]) / args.events for b in busy])
        print(f"{'':8s} database commits per delivery (the GETs' taken off): {own:.3f}")
    print(json.dumps({"met": ok}))


if __name__ == "__main__":
    main()
