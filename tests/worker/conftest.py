"""Worker test harness: a real Celery worker process, real Redis, real torchrun ranks on CPU.

Tasks are sent by name exactly as the service sends them; what the tests look at is what the
worker puts on the wire (the per-job event stream, heartbeat, registry) and the process table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import RedisDBs
from trainer.data import write_shard
from trainer.events import Event, Keys
from worker.message import TASK_NAME, JobMessage, broker_queue

TINY: dict[str, Any] = {
    "steps": 20,
    "seed": 1,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "tiny"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 0},
    "checkpoint": {"every": 10, "keep": 2, "hf": "none"},  # no HF folder: not tested here
}


def tiny(**overrides: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(TINY))
    cfg.update(overrides)
    return cfg


def message(job_id: str, attempt: int = 1, procs: int = 2, **kw: Any) -> JobMessage:
    train = kw.pop("train", None) or tiny()
    return JobMessage.model_validate(
        {"job_id": job_id, "attempt": attempt, "queue": "cpu", "procs_per_node": procs,
         "train": train, **kw}
    )  # fmt: skip


def new_job() -> str:
    return f"j{uuid.uuid4().hex[:10]}"


def wait_for(
    pred: Callable[[], Any],
    timeout: float,
    what: str,
    step: float = 0.1,
    progress: Callable[[], Any] | None = None,
) -> Any:
    """Poll until ``pred()`` is truthy; fail after ``timeout`` s. With ``progress``, the
    ``timeout`` s count from the last change of ``progress()``: a run that keeps reporting
    is slow (a loaded machine), not stuck, and is waited for."""
    deadline = time.monotonic() + timeout
    seen = progress() if progress is not None else None
    while True:
        value = pred()
        if value:
            return value
        if progress is not None and (now := progress()) != seen:
            seen, deadline = now, time.monotonic() + timeout
        if time.monotonic() > deadline:
            idle = " with no progress" if progress is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s{idle} waiting for {what}")
        time.sleep(step)


def wrong_modes(root: Path) -> dict[str, str]:
    """What under ``root`` (itself included) is not a 0750 folder or a 0640 file."""
    found = {}
    for p in [root, *root.rglob("*")]:
        mode = p.lstat().st_mode & 0o777
        if mode != (0o750 if p.is_dir() else 0o640):
            found[str(p.relative_to(root))] = oct(mode)
    return found


def run_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run dir (torchrun, ranks), by /proc."""
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def rank_pid(run_dir: Path, rank: int) -> int | None:
    for pid in run_processes(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"RANK={rank}".encode() in env
            and b"-m\0trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ):
            return pid
    return None


def assert_stopped_log(lines: list[dict[str, Any]], why: str) -> None:
    """A run the worker stopped: its log ends with the worker's one line saying why and at
    which step, and holds none of torchrun's agent traceback or shutdown notices."""
    text = "\n".join(ln["line"] for ln in lines)
    for noise in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert noise not in text, text[-3000:]
    assert "FutureWarning" not in text, "a deprecated call printed by every rank"
    last = lines[-1]
    assert last["rank"] is None and last["line"].startswith(f"trainq: {why}"), last
    assert re.search(r"; stopped at step \d+ \(checkpoint saved\)$", last["line"]), last
    assert [ln["line"] for ln in lines if why in ln["line"]] == [last["line"]], "one line"


class Wire:
    """Reads one Redis database the way the service does: per-job streams and keys."""

    def __init__(self, url: str, broker_url: str) -> None:
        import celery
        import redis

        self.url = url
        self.r: Any = redis.Redis.from_url(url, socket_timeout=5)
        self.keys = Keys()
        self.sender = celery.Celery(broker=broker_url)

    def send(self, msg: JobMessage) -> None:
        self.sender.send_task(TASK_NAME, args=[msg.to_json()], queue=broker_queue(msg.queue))

    def events(self, job_id: str) -> list[Event]:
        entries: list[Any] = self.r.xrange(self.keys.job(job_id))
        return [Event.from_fields(f) for _, f in entries]

    def lifecycle(self, job_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
        return [e.data for e in self.events(job_id)
                if e.kind == "lifecycle" and (attempt is None or e.attempt == attempt)]  # fmt: skip

    def exited(self, job_id: str, attempt: int, timeout: float = 90) -> dict[str, Any]:
        """The attempt's exit event; fails once the job's stream has not grown for
        ``timeout`` s: a live run keeps appending metrics and logs, so on a loaded machine
        a slow run is waited for, and a stuck one is not."""

        def find() -> dict[str, Any] | None:
            for d in self.lifecycle(job_id, attempt):
                if d["phase"] == "exited":
                    return d
            return None

        return wait_for(find, timeout, f"the exit of {job_id}:{attempt}", 0.2,
                        progress=lambda: self.r.xlen(self.keys.job(job_id)))  # fmt: skip

    def metrics(self, job_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
        return [e.data for e in self.events(job_id)
                if e.kind == "metric" and (attempt is None or e.attempt == attempt)]  # fmt: skip

    def log_lines(self, job_id: str) -> list[dict[str, Any]]:
        return [ln for e in self.events(job_id) if e.kind == "log" for ln in e.data["lines"]]

    def cancel(self, job_id: str) -> None:
        self.r.set(self.keys.cancel(job_id), "1", ex=3600)
        self.r.publish(self.keys.cancel_channel(), job_id)

    def worker_entry(self, name: str) -> dict[str, Any] | None:
        raw = self.r.hget(self.keys.workers, name)
        return json.loads(raw) if raw else None


class WorkerProc:
    """`python -m worker` as a child process, in its own session (so cleanup is exact)."""

    def __init__(self, env: dict[str, str], log_path: Path, wire: Wire, name: str,
                 slots: int = 1, gpus: str | None = None, umask: int = -1) -> None:  # fmt: skip
        self.name = name
        self.wire = wire
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--queues", "cpu", "--slots", str(slots),
             "--hostname", name, *(["--gpus", gpus] if gpus else [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            umask=umask,  # -1: the test's own
        )  # fmt: skip
        try:
            wait_for(lambda: wire.worker_entry(name) or self.proc.poll() is not None, 60,
                     f"worker {name} to register")  # fmt: skip
        except AssertionError:
            self.stop()
            raise
        assert self.proc.poll() is None, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(10)
        self._log.close()
        return code


@pytest.fixture(scope="session")
def broker_url(redis_dbs: RedisDBs) -> str:
    return redis_dbs.url(redis_dbs.claim())


def _with_meta(folder: Path, vocab: int, top: int, rng: np.random.Generator) -> None:
    """Shards of ids below ``top`` and the meta.json trainer.prepare writes, saying ``vocab``."""
    train, val = rng.integers(0, top, 40_000), rng.integers(0, top, 4_000)
    write_shard(folder / "train_000000.bin", train)
    write_shard(folder / "val_000000.bin", val)
    meta = {"out": str(folder), "tokenizer": "tokenizer.json", "vocab_size": vocab,
            "train_tokens": train.size, "val_tokens": val.size, "train_shards": 1,
            "val_shards": 1}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny``: bytes, as the debug model's vocab of 256 wants them. ``gpt2``: GPT-2's
    vocab (50257) by its meta.json. ``stale``: ids up to 299 under a meta.json that says
    256 (a dataset rewritten by hand), so only the first forward pass finds them."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    write_shard(root / "tiny" / "train_000.bin", rng.integers(0, 256, 40_000))
    write_shard(root / "tiny" / "val_000.bin", rng.integers(0, 256, 4_000))
    _with_meta(root / "gpt2", 50257, 50257, rng)
    _with_meta(root / "stale", 256, 300, rng)
    return root


@pytest.fixture()
def worker_env(
    subprocess_env: dict[str, str], data_root: Path, tmp_path: Path
) -> Callable[..., dict[str, str]]:
    def make(redis_url: str, broker_url: str, **settings: Any) -> dict[str, str]:
        env = dict(subprocess_env)
        env.update({
            "TRAINQ_REDIS_URL": redis_url,
            "TRAINQ_BROKER_URL": broker_url,
            "TRAINQ_DATA_ROOT": str(data_root),
            "TRAINQ_RUNS_ROOT": str(tmp_path / "runs"),
            "TRAINQ_HEARTBEAT_TTL_S": "3",
            "TRAINQ_CANCEL_GRACE_S": "15",
            "TRAINQ_CANCEL_POLL_S": "0.5",
            "TRAINQ_REGISTRY_INTERVAL_S": "1",
            "TRAINQ_LOG_BATCH_S": "0.1",
        })  # fmt: skip
        env.update({f"TRAINQ_{k.upper()}": str(v) for k, v in settings.items()})
        return env

    return make


@pytest.fixture()
def wire(redis_url: str, broker_url: str) -> Iterator[Wire]:
    import redis

    for url in (redis_url, broker_url):
        redis.Redis.from_url(url).flushdb()
    w = Wire(redis_url, broker_url)
    yield w
    w.r.close()


@pytest.fixture()
def start_worker(
    worker_env: Callable[..., dict[str, str]],
    wire: Wire,
    redis_url: str,
    broker_url: str,
    tmp_path: Path,
) -> Iterator[Callable[..., WorkerProc]]:
    started: list[WorkerProc] = []

    def start(
        name: str = "w1",
        slots: int = 1,
        gpus: str | None = None,
        *,
        env: dict[str, str | None] | None = None,
        umask: int = -1,
        **settings: Any,
    ) -> WorkerProc:
        """A worker; ``env`` sets (or, with None, removes) variables of its environment
        beyond the TRAINQ_* ``settings``; ``umask`` is the one it starts with."""
        full = worker_env(redis_url, broker_url, **settings)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        w = WorkerProc(full, tmp_path / f"{name}.log", wire, name, slots, gpus, umask)
        started.append(w)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.stop(signal.SIGKILL)
        else:
            w.stop()


@pytest.fixture()
def runs_root(tmp_path: Path) -> Path:
    return tmp_path / "runs"
