"""A whole running trainq system for end-to-end tests, and where the browser is.

The system is real: the API served by uvicorn (with its ingestor and reconciler threads) on a
free loopback port, PostgreSQL (``pg_url``, migrated as ``trainq db upgrade`` does), Redis (two
database numbers of this session: events and the Celery broker), and a Celery worker that
launches the trainer with torchrun on CPU. The browser is Debian's chromium driven by
Playwright; no browser is downloaded (``playwright install`` is never run).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

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

# The API process: create_app() plus the dashboard router, in case the app does not include
# it yet, served by a real uvicorn.
API_MAIN = """
import sys
import uvicorn
from starlette.routing import NoMatchFound
import service.dashboard
from service.app import create_app

app = create_app()
try:
    app.url_path_for("dashboard")
except NoMatchFound:
    app.include_router(service.dashboard.router)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
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

    def start_worker(self, queue: str) -> Proc:
        import redis

        name = f"dash-{os.getpid()}"
        proc = start(
            f"worker-{queue}",
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
