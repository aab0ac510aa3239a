"""A whole running trainq system for end-to-end tests, and where the browser is.

The system is real: the API served by uvicorn (with its ingestor and reconciler threads) on a
free loopback port, PostgreSQL (``pg_url``, migrated as ``trainq db upgrade`` does), Redis (two
database numbers of this session: events and the Celery broker), and Celery workers that
launch the trainer with torchrun on CPU. The browser is Debian's chromium driven by
Playwright; no browser is downloaded (``playwright install`` is never run).

What the system tests read back is also here: a follower of a job's SSE stream that records
when each event arrived, and the run's processes found in ``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import RedisDBs

CHROMIUM = Path(os.environ.get("TRAINQ_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The API process: create_app() (which serves the dashboard too) under a real uvicorn.
API_MAIN = """
import sys
import uvicorn
from service.api.app import create_app

uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A child process in its own session, so stopping it also stops what it launched."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive():
            return
        pgid = os.getpgid(self.popen.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.popen.wait(5)


def start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log)


@dataclass
class Api:
    url: str
    proc: Proc
    token: str | None = None

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


@dataclass
class System:
    env: dict[str, str]
    redis_url: str
    prefix: str
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    # The Redis databases build_system claimed for this system alone: given back by stop(),
    # so that the session's 14 test databases outlast any number of test modules.
    dbs: RedisDBs | None = None
    claimed: list[int] = field(default_factory=list)

    def start_api(self, *, auth: bool) -> Api:
        port = free_port()
        env = {**self.env, "TRAINQ_AUTH": "on" if auth else "off"}
        proc = start(f"api-{port}", [sys.executable, "-c", API_MAIN, str(port)], env, self.log_dir)
        self.procs.append(proc)
        api = Api(f"http://127.0.0.1:{port}", proc)

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"the API exited early:\n{proc.tail()}")
            try:
                return httpx.get(f"{api.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, "the API to answer /healthz", every=0.2)
        return api

    def start_worker(self, queue: str, name: str | None = None) -> Proc:
        """``python -m worker`` with one slot; ``name`` (its registry and Celery hostname)
        must differ between workers that run at the same time."""
        import redis

        log_name = f"worker-{queue}" if name is None else f"worker-{name}"
        name = name or f"dash-{os.getpid()}"
        proc = start(
            log_name,
            [sys.executable, "-m", "worker", "--queues", queue, "--slots", "1", "--hostname", name],
            self.env,
            self.log_dir,
        )
        self.procs.append(proc)
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)

        def registered() -> bool:
            if not proc.alive():
                raise RuntimeError(f"the worker exited early:\n{proc.tail()}")
            return any(name in str(f) for f in client.hkeys(f"{self.prefix}:workers"))

        wait_for(registered, 60, "the worker to register", every=0.2)
        client.close()
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        if self.dbs is not None:
            for n in self.claimed:
                self.dbs.give_back(n)
        self.claimed.clear()


def build_system(
    root: Path,
    pg_url: str,
    redis_dbs: RedisDBs,
    subprocess_env: dict[str, str],
    settings: dict[str, str],
    redis_urls: tuple[str, str] | None = None,
) -> System:
    """Stores and settings of one system under ``root``: the demo corpus in the data root,
    two fresh Redis databases (events, broker; or ``redis_urls``), a migrated database.
    Processes come later."""
    from service.api.core.migrate import upgrade
    from trainer.prepare import prepare_demo

    data_root = root / "data"
    prepare_demo(data_root / "demo")
    claimed: list[int] = []
    if redis_urls is None:
        claimed = [redis_dbs.claim(), redis_dbs.claim()]
        redis_urls = (redis_dbs.url(claimed[0]), redis_dbs.url(claimed[1]))
    redis_url, broker_url = redis_urls
    prefix = "trainq"
    env = {
        **subprocess_env,
        "TRAINQ_DATABASE_URL": pg_url,
        "TRAINQ_REDIS_URL": redis_url,
        "TRAINQ_BROKER_URL": broker_url,
        "TRAINQ_REDIS_PREFIX": prefix,
        "TRAINQ_DATA_ROOT": str(data_root),
        "TRAINQ_RUNS_ROOT": str(root / "runs"),
        **settings,
    }
    log_dir = root / "logs"
    log_dir.mkdir()
    upgrade(pg_url)  # what `trainq db upgrade` runs; a no-op if another module already did
    return System(env, redis_url, prefix, log_dir, dbs=redis_dbs, claimed=claimed)


def create_token(database_url: str, owner: str) -> str:
    """A real API token, made the way `trainq token create` makes one."""
    from service.api.core.auth import create_token as create
    from service.api.core.db import make_engine, make_sessionmaker
    from service.api.core.settings import Settings

    engine = make_engine(Settings(database_url=database_url))
    try:
        with make_sessionmaker(engine).begin() as session:
            return create(session, owner)
    finally:
        engine.dispose()


def run_processes(job_id: str, run_dir: Path) -> list[int]:
    """Live processes of a run, read from /proc (the process table, not the job's status).

    A process belongs to the run if its environment names the job (the worker hands
    TRAINQ_JOB_ID to the guard, torchrun and every rank), or its working directory or
    command line is under the run dir. Zombies are not running, so they are not counted.
    """
    marker = f"TRAINQ_JOB_ID={job_id}".encode()
    run_dir = run_dir.resolve()
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        proc = Path("/proc") / entry
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state in ("Z", "X"):
            continue
        if marker in environ or needle in cmdline or cwd.is_relative_to(run_dir):
            found.append(int(entry))
    return found


@dataclass
class SseEvent:
    event: str
    data: dict[str, Any]
    id: str | None
    at: float  # time.time() when this client received it


class SseFollower:
    """Follows ``GET /v1/jobs/{id}/events`` in a thread and records each event on arrival.

    ``closed`` is set when the server ends the stream; ``error`` holds what broke it
    otherwise (a read timeout, a refused connection, a non-200 answer).
    """

    def __init__(self, api: Api, job_id: str, read_timeout: float = 30.0) -> None:
        self.api = api
        self.job_id = job_id
        self.read_timeout = read_timeout
        self.events: list[SseEvent] = []
        self.opened = threading.Event()
        self.closed = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"sse-{job_id}", daemon=True)

    def start(self, timeout: float = 10.0) -> SseFollower:
        self.thread.start()
        if not self.opened.wait(timeout) or self.error is not None:
            raise RuntimeError(f"the event stream of {self.job_id} did not open: {self.error}")
        return self

    def _run(self) -> None:
        timeout = httpx.Timeout(10.0, read=self.read_timeout)
        try:
            with (
                self.api.client() as client,
                client.stream("GET", f"/v1/jobs/{self.job_id}/events", timeout=timeout) as resp,
            ):
                if resp.status_code != 200:
                    raise RuntimeError(f"GET events answered {resp.status_code}")
                self.opened.set()
                self._parse(resp.iter_lines())
            self.closed.set()
        except BaseException as exc:  # kept for the test to report; the thread just ends
            self.error = exc
            self.opened.set()

    def _parse(self, lines: Any) -> None:
        event, entry_id = "message", None
        data: list[str] = []
        for line in lines:
            if not line:
                if data:
                    self.events.append(
                        SseEvent(event, json.loads("\n".join(data)), entry_id, time.time())
                    )
                event, data, entry_id = "message", [], None
            elif line.startswith(":"):
                continue  # a ping
            else:
                key, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if key == "event":
                    event = value
                elif key == "data":
                    data.append(value)
                elif key == "id":
                    entry_id = value

    def wait_closed(self, timeout: float) -> list[SseEvent]:
        """Every event, once the server has closed the stream (TimeoutError otherwise)."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the event stream of {self.job_id} still open after {timeout}s")
        if not self.closed.is_set():
            raise RuntimeError(f"the event stream of {self.job_id} broke: {self.error!r}")
        return self.events
