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

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
            from service.api.core.migrate import upgrade

            upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def make_token(pg_url: str, name: str, *, admin: bool = False) -> str:
    from sqlalchemy.orm import Session

    from service.api.core.auth import create_token

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


def start_worker(env: dict[str, str], queue: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    """``python -m worker`` serving ``queue`` as ``name``, in its own session (so
    ``stop_worker`` ends its children too), its output in ``log``."""
    argv = [sys.executable, "-m", "worker", "--queues", queue, "--hostname", name]
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    os.killpg(os.getpgid(worker.pid), signal.SIGTERM)
    worker.wait(30)


def train_job(
    client: httpx.Client, queue: str, name: str, train: dict[str, Any], log: Path,
    timeout: float = 300,
) -> str:  # fmt: skip
    """Submit a job to ``queue`` and wait for it to succeed (the worker's ``log`` tail if it
    does not in ``timeout`` s); its id."""
    r = client.post("/v1/jobs", json={"name": name, "queue": queue, "train": train})
    assert r.status_code == 201, r.text
    job = str(r.json()["id"])
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/jobs/{job}").json()["status"] != "succeeded":
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    return job


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
