"""Shared parts of the service benchmarks: a fresh store, a served API, load generators.

- ``Stack``: a fresh PostgreSQL database (created and dropped as ``tests/conftest.py`` pg_url
  does, migrated as ``trainq db upgrade`` does), Redis database numbers claimed as the tests'
  ``RedisDBs`` claims them (events, and the Celery broker on its own number), a data root
  with the default ``tiny`` dataset folder, and an API token of a non-admin owner.
- ``serve``: uvicorn as a subprocess on a free loopback port with N workers, in its own
  process group so stopping it stops its workers. Every server a benchmark compares runs
  with the same ``UVICORN_ARGS``.
- ``wrk``: Debian's wrk (C, one thread) with a Lua ``done`` that prints JSON.
- ``post_load``: a small asyncio HTTP/1.1 keep-alive client bounded by count and time, for
  the POST benchmark, where every response has to be counted exactly.
- ``percentiles`` and ``alternate`` (A B B A ... so drift cancels).
- For the trainer benchmarks: ``torchrun``, ``launch`` (one job, its ranks' CPU sampled from
  /proc, its peak RSS from wait4), ``step_rates`` (wall and CPU tokens/s from the step
  stamps) and ``step_records`` (the trainer's metrics.jsonl).

All traffic goes to 127.0.0.1. The machine has 2 cores: the load generator, the API,
PostgreSQL and Redis share them, which every benchmark says in its output.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from tests.conftest import PG_ADMIN_URL, RedisDBs  # noqa: E402

# The same for every server in a comparison: uvicorn's defaults (uvloop and httptools when
# installed, as they are here), access log off, warnings only.
UVICORN_ARGS = ["--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "30"]
CORES = os.cpu_count() or 1
SHARED_CORES_NOTE = (
    f"note: {CORES} cores shared by the load generator, the API workers, PostgreSQL and Redis;"
    " figures are for this machine, not for a dedicated server"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(tree: Path = REPO) -> dict[str, str]:
    """Environment for a server process: ``tree``'s packages importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass
class Server:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """The uvicorn master and its worker processes (for py-spy)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.popen.pid)], capture_output=True, text=True
        ).stdout
        return [self.popen.pid, *(int(p) for p in out.split())]

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the master and its workers."""
        return cpu_seconds(self.pids())

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is not None:
            return
        pgid = os.getpgid(self.popen.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.popen.wait(5)


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def postgres_pids() -> list[int]:
    """Every PostgreSQL backend on this machine (others' too: a rough figure)."""
    out = subprocess.run(["pgrep", "-f", "^postgres"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def serve(
    target: str,
    *,
    env: dict[str, str],
    workers: int,
    log_dir: Path,
    ready_path: str,
    factory: bool = False,
    name: str = "api",
    timeout: float = 60.0,
) -> Server:
    """Start ``uvicorn target`` on a free loopback port; return once ``ready_path`` is 200."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--workers", str(workers), *UVICORN_ARGS, *(["--factory"] if factory else [])]
    log = log_dir / f"{name}-{port}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=env.get("PYTHONPATH", str(REPO)),
        )
    server = Server(name, f"http://127.0.0.1:{port}", popen, log)
    deadline = time.monotonic() + timeout
    while True:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{server.tail()}")
        try:
            if httpx.get(server.url + ready_path, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not answer {ready_path} in {timeout:.0f}s")
        time.sleep(0.2)
    # Every worker process has to be up, not just the first one that answered.
    time.sleep(0.5 * workers)
    return server


@contextmanager
def fresh_pg(migrate: bool = True) -> Iterator[str]:
    """A new PostgreSQL database for this run, dropped afterwards."""
    name = f"trainq_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        if migrate:
            from service.api.migrate import upgrade

            upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def make_token(pg_url: str, name: str, *, admin: bool = False) -> str:
    from sqlalchemy.orm import Session

    from service.api.auth import create_token

    engine = sa.create_engine(pg_url)
    try:
        with Session(engine) as session, session.begin():
            return create_token(session, name, admin=admin)
    finally:
        engine.dispose()


@dataclass
class Stack:
    """A fresh store and wires for one service under test; ``env`` configures its API."""

    pg_url: str
    redis_url: str
    broker_url: str
    tmp: Path
    token: str
    owner: str
    servers: list[Server] = field(default_factory=list)

    def env(self, tree: Path = REPO, **overrides: str) -> dict[str, str]:
        env = base_env(tree)
        env.update(
            TRAINQ_DATABASE_URL=self.pg_url,
            TRAINQ_REDIS_URL=self.redis_url,
            TRAINQ_BROKER_URL=self.broker_url,
            TRAINQ_REDIS_PREFIX="trainq",
            TRAINQ_DATA_ROOT=str(self.tmp / "data"),
            TRAINQ_RUNS_ROOT=str(self.tmp / "runs"),
            TRAINQ_AUTH="on",
        )
        env.update(overrides)
        return env

    def serve_api(self, workers: int, tree: Path = REPO, **overrides: str) -> Server:
        server = serve(
            "service.api.app:create_app",
            factory=True,
            env=self.env(tree, **overrides),
            workers=workers,
            log_dir=self.tmp,
            ready_path="/healthz",
            name="api" if tree == REPO else "api-copy",
        )
        self.servers.append(server)
        return server

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextmanager
def stack(owner: str = "bench") -> Iterator[Stack]:
    dbs = RedisDBs()
    tmp = Path(tempfile.mkdtemp(prefix="trainq-bench-"))
    (tmp / "data" / "tiny").mkdir(parents=True)
    made: Stack | None = None
    try:
        with fresh_pg() as pg_url:
            made = Stack(
                pg_url=pg_url,
                redis_url=dbs.url(dbs.claim()),
                broker_url=dbs.url(dbs.claim()),
                tmp=tmp,
                token=make_token(pg_url, owner),
                owner=owner,
            )
            try:
                yield made
            finally:
                for server in reversed(made.servers):
                    server.stop()
    finally:
        dbs.release()
        shutil.rmtree(tmp, ignore_errors=True)


# --- load generators -------------------------------------------------------------------

WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,'
    .. '"status":%d,"timeout":%d,"p50_ms":%.3f,"p90_ms":%.3f,"p99_ms":%.3f,'
    .. '"max_ms":%.3f,"mean_ms":%.3f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000, latency.mean / 1000))
end
"""


def wrk(
    url: str,
    *,
    connections: int,
    duration_s: float,
    headers: dict[str, str] | None = None,
    tmp: Path,
) -> dict[str, float]:
    """GET ``url`` with wrk (one thread, keep-alive) for ``duration_s``; requests/s, latency."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    script = tmp / "wrk_done.lua"
    script.write_text(WRK_DONE)
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "5s"]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    argv += ["-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            r = json.loads(line[len("WRKJSON ") :])
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
            r["errors"] = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
            return r
    raise RuntimeError(f"wrk gave no result:\n{out.stdout}\n{out.stderr}")


@dataclass
class LoadResult:
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    failures: int = 0  # connection errors, timeouts: no status at all

    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if 200 <= s < 300)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    chunked = False
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            length = int(v)
        elif k == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length)
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, body
        body += chunk[:-2]


async def _post_load(
    port: int,
    path: str,
    make_body: Callable[[int], bytes],
    headers: dict[str, str],
    *,
    connections: int,
    total: int,
    max_s: float,
) -> LoadResult:
    result = LoadResult()
    counter = iter(range(total))
    deadline = time.monotonic() + max_s
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in counter:  # shared: each request index is taken exactly once
                if time.monotonic() > deadline:
                    return
                body = make_body(i)
                req = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
                t0 = time.perf_counter()
                result.sent += 1
                writer.write(req)
                try:
                    status, _ = await asyncio.wait_for(_read_response(reader), 10)
                except (TimeoutError, OSError, asyncio.IncompleteReadError):
                    result.failures += 1
                    return
                result.latencies.append(time.perf_counter() - t0)
                result.statuses[status] = result.statuses.get(status, 0) + 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_connection() for _ in range(connections)))
    result.elapsed_s = time.perf_counter() - t0
    return result


def post_load(
    url: str,
    path: str,
    make_body: Callable[[int], bytes],
    headers: dict[str, str],
    *,
    connections: int,
    total: int,
    max_s: float,
) -> LoadResult:
    """POST ``total`` requests (at most ``max_s`` seconds) over keep-alive connections."""
    port = int(url.rsplit(":", 1)[1])
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(
        _post_load(
            port, path, make_body, headers, connections=connections, total=total, max_s=max_s
        )
    )


# --- statistics ------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99/max of ``values`` (seconds), times ``scale`` (ms by default)."""
    s = sorted(values)
    return {
        "n": float(len(s)),
        "p50": percentile(s, 50) * scale,
        "p90": percentile(s, 90) * scale,
        "p99": percentile(s, 99) * scale,
        "max": (s[-1] * scale) if s else float("nan"),
    }


def alternate(rounds: int, sides: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run each side ``rounds`` times, A B / B A / A B ..., so slow drift hits both alike."""
    names = list(sides)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else reversed(names):
            out[n].append(sides[n]())
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# --- trainer benchmarks: torchrun jobs, timed by the stamps their own steps write --------
# (bench/trainer_throughput.py, bench/models.py). A job's CPU is its ranks' utime + stime
# from /proc, sampled every 50 ms while it runs and interpolated at the step stamps.

TICK = os.sysconf("SC_CLK_TCK")


def torchrun(nproc: int) -> list[str]:
    """The launcher's argv up to the script: ``nproc`` ranks on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc)]  # fmt: skip


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # minus idle and iowait


def _proc_stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, utime + stime ticks) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return int(rest[1]), int(rest[11]) + int(rest[12])


def ranks_cpu(pid: int, launcher: bool) -> float:
    """CPU seconds so far of the ranks: a launcher's children, or the process itself."""
    if not launcher:
        st = _proc_stat(str(pid))
        return (st[1] if st else 0) / TICK
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(entry)) is not None and st[0] == pid:
            total += st[1]
    return total / TICK


@dataclass
class Launch:
    samples: list[tuple[float, float]]  # (unix time, ranks' CPU seconds)
    others: float  # share of the machine's CPUs that other processes used during the job
    peak_rss: int  # bytes: ru_maxrss from wait4, the largest process of the tree


def launch(
    argv: list[str],
    log: Path,
    timeout: float,
    *,
    launcher: bool,
    extra_env: dict[str, str] | None = None,
) -> Launch:
    """Run one job to its end (``launcher``: torchrun, whose children are the ranks; else
    the one rank itself), output to ``log``; exits the benchmark, with the log's tail, when
    it fails or runs past ``timeout`` seconds."""
    env = base_env() | (extra_env or {})
    env.pop("TRAINQ_REDIS_URL", None)  # the benches measure the trainer, not a Redis
    samples: list[tuple[float, float]] = []
    busy0, total0 = machine_ticks()
    ours0 = os.times()
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            samples.append((time.time(), ranks_cpu(proc.pid, launcher)))

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        # wait4 on the one pid, not Popen.wait or RUSAGE_CHILDREN: the rusage of this child
        # (and the descendants it reaped), not the maximum over every child reaped so far.
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        done.set()
        sampler.join()
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    busy1, total1 = machine_ticks()
    ours1 = os.times()
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        why = f"ran past {timeout:.0f} s" if code == -signal.SIGKILL else f"exit code {code}"
        sys.exit(f"{' '.join(argv[-8:])} failed ({why}); last lines of {log}:\n{tail}")
    ours = ours1.children_user + ours1.children_system - ours0.children_user - ours0.children_system
    others = max(0.0, (busy1 - busy0) / TICK - ours) / max(1e-9, (total1 - total0) / TICK)
    return Launch(samples, others, usage.ru_maxrss * 1024)  # Linux: KiB


def step_rates(
    stamps: list[float], warmup: int, tokens_per_step: int, run: Launch, nproc: int
) -> tuple[float, float]:
    """(wall, cpu) tokens/s over the steps after the ``warmup`` first ones, from the unix
    time stamped at the end of each step: wall ``tokens / (t[last] - t[warmup - 1])``; cpu
    the same tokens over the ranks' CPU seconds in that window, times ``nproc`` (the
    tokens/s with a core per rank to itself: the figure to compare on a shared machine)."""
    start, end = stamps[warmup - 1], stamps[-1]
    tokens = (len(stamps) - warmup) * tokens_per_step
    t = np.array([s[0] for s in run.samples])
    c = np.maximum.accumulate(np.array([s[1] for s in run.samples]))  # an exit drops ticks
    cpu_s = float(np.interp(end, t, c) - np.interp(start, t, c))
    return tokens / (end - start), tokens / max(1e-9, cpu_s / nproc)


def step_records(run_dir: Path, expected: int) -> list[dict[str, Any]]:
    """The trainer's metrics.jsonl step records, by step; exits unless there are ``expected``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = sorted((r for r in map(json.loads, lines) if "loss" in r), key=lambda r: r["step"])
    if len(records) != expected:
        sys.exit(f"{run_dir}/metrics.jsonl has {len(records)} step records, expected {expected}")
    return records
