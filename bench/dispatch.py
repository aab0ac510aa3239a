"""Dispatch latency and reporting cost of the worker, measured side by side with bare torchrun.

    .venv/bin/python bench/dispatch.py [--samples 15] [--rounds 3] [--steps 80] [--slices 30]
                                       [--pairs 1]

Starts its own redis-server on a free port (events on db 0, the Celery broker on db 1) and
one ``python -m worker --queues cpu --slots 1``, then sends tasks by name exactly as the
service does (``send_task(TASK_NAME, args=[JobMessage.to_json()], queue="cpu")``).

1. submit -> exec, on an idle worker (goal p50 <= 50 ms), ``--samples`` times:
   - guard exec: the ``running`` event's time stamp (the worker stamps it as soon as Popen
     returns, i.e. after the guard's exec succeeded);
   - torchrun exec: the start time of the torchrun process in /proc (clock ticks, 10 ms
     resolution), found by polling the process table.
   Each sample is cancelled as soon as torchrun is seen, so samples are cheap.
2. submit -> first metric on the wire (the Redis stream entry id of the first metric, ms),
   against a bare ``torchrun -m trainer`` of the same config from Popen to its first step
   (the ``time`` of the first record in metrics.jsonl). Goal: ratio <= 1.2. Not through the
   HTTP API: this measures the worker's share (Celery, claim, launch, log/metric path).
   Beside it, the other end: from the last step to the exit event (worker), against the last
   step to torchrun's exit (bare). Also: a task queued behind a busy slot, from the exit of
   the run before it to its own launch.
3. training throughput, worker vs bare torchrun, same config, 2 ranks, ``--rounds`` rounds
   in alternating order; tokens/s over the steps after the first ``--warmup`` from each run's
   metrics.jsonl ``time`` stamps. Goal: ratio >= 0.98. Beside it, the CPU per step of the
   ranks and of everything else the worker path runs (torchrun and the guard, the worker,
   redis-server), sampled from /proc: on a shared 2-core machine wall-clock throughput
   moves by several percent between runs, CPU time far less.
4. the same ratio, interleaved: a worker run and a bare run alive at once, taking turns of
   ``--slice-s`` (the other held with SIGSTOP), ``--slices`` turns each. Runs one after the
   other on these VMs drift 10-20 % in speed within minutes, so (3) swings by as much from
   one bench run to the next; taking turns puts both sides under the same drift. An A/A
   check (two bare runs taking turns) gave first/second 1.024, 1.008, 1.002 (20 turns each)
   and 1.011, 1.028 (60 turns): the run started second runs 1-3 % slower, so this is done
   twice, each side first once, and the ratio reported is the geometric mean of the two;
   what is left of that bias, about +-1.5 %, is this measure's noise. ``--pairs`` repeats
   both orders; the ratio is the geometric mean of all. Beside it, CPU per step within the
   turns: both sides' ranks and torchrun, and what the worker process and redis-server
   spend in the worker's turns beyond the bare's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import redis  # noqa: E402
from celery import Celery  # noqa: E402

from trainer.data import write_shard  # noqa: E402
from trainer.events import Event, Keys  # noqa: E402
from worker.message import TASK_NAME, JobMessage  # noqa: E402

CFG: dict[str, Any] = {
    "steps": 80,
    "seed": 1,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64, "vocab_size": 256},
    "data": {"path": "tiny"},
    "batch": {"micro_batch_size": 8},
    "eval": {"every": 0},
    "checkpoint": {"every": 0, "keep": 1},
}


# A run's processes that are not ranks: the guard, and torchrun (trainer.torchrun for the
# worker, torch.distributed.run for the bare side).
LAUNCH = (b"guard.py", b"torchrun", b"torch.distributed.run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(pred: Any, timeout: float, what: str, step: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        time.sleep(step)


def boot_time() -> float:
    return time.time() - float(Path("/proc/uptime").read_text().split()[0])


def run_processes(run_dir: Path) -> Iterator[tuple[int, bytes]]:
    """(pid, cmdline) of every process whose command line names ``run_dir``."""
    needle = str(run_dir).encode()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                cmd = Path(f"/proc/{e}/cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmd:
                yield int(e), cmd


def find_torchrun(run_dir: Path) -> int | None:
    for pid, cmd in run_processes(run_dir):
        if b"torchrun" in cmd and b"guard.py" not in cmd:
            return pid
    return None


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (field 3 on, 0-based here)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 once it is gone)."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RunCPU:
    """CPU seconds of a run's processes, by role, sampled from /proc while it runs.

    The counters are cumulative, so a process found late loses nothing; what it spends
    after its last sample (under 50 ms) is missed on both sides. The process table is
    scanned for new processes only every 0.25 s (a scan costs ~1.5 ms of CPU, taken from the
    run being timed), the ones already found are read every 50 ms.

    ranks: the trainer processes; launch: torchrun and the guard. With ``extra`` pids
    (the worker, redis-server), their CPU over the same span is counted under their names.
    """

    def __init__(self, run_dir: Path, extra: dict[str, int] | None = None) -> None:
        self.run_dir = run_dir
        self.extra = extra or {}
        self.start = {name: cpu_s(pid) for name, pid in self.extra.items()}
        self.roles: dict[int, str] = {}
        self.seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        tick = 0
        while not self._stop.wait(0.05):
            if tick % 5 == 0:
                for pid, cmd in run_processes(self.run_dir):
                    self.roles.setdefault(pid, role_of(cmd))
            tick += 1
            for pid, role in self.roles.items():
                cpu = cpu_s(pid)
                if cpu:
                    self.seen[pid] = (role, cpu)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        out = {"ranks": 0.0, "launch": 0.0}
        for role, cpu in self.seen.values():
            out[role] += cpu
        for name, pid in self.extra.items():
            out[name] = cpu_s(pid) - self.start[name]
        return out


def role_of(cmd: bytes) -> str:
    return "launch" if any(w in cmd for w in LAUNCH) else "ranks"


def tokens_per_step(cfg: dict[str, Any], procs: int = 2) -> int:
    """Tokens of one step of ``cfg`` on ``procs`` ranks (every run here has 2)."""
    return int(cfg["batch"]["micro_batch_size"] * cfg["model"]["seq_len"] * procs)


def start_time(pid: int, boot: float) -> float:
    return boot + int(stat_fields(pid)[19]) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def throughput(run_dir: Path, warmup: int, tokens_per_step: int) -> float:
    t = metric_times(run_dir)
    return tokens_per_step * (len(t) - warmup) / (t[-1] - t[warmup - 1])


def metric_times(run_dir: Path) -> list[float]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    # A process stopped mid-write leaves a partial last line; it is read once it is whole.
    return [float(json.loads(x)["time"]) for x in text.splitlines() if x.endswith("}")]


def metric_count(run_dir: Path) -> int:
    return len(metric_times(run_dir))


def windowed_throughput(run_dir: Path, windows: list[tuple[float, float]], tps: int) -> float:
    """tok/s over the steps that began and ended within one window (a step's start is the
    previous step's end)."""
    t = metric_times(run_dir)
    steps, spent = 0, 0.0
    for a, b in windows:
        inside = [x for x in t if a <= x <= b]
        steps += len(inside) - 1 if inside else 0
        spent += inside[-1] - inside[0] if inside else 0.0
    return tps * steps / spent


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Bench:
    def __init__(self, work: Path, steps: int) -> None:
        self.work = work
        self.port = free_port()
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(work)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.broker = f"redis://127.0.0.1:{self.port}/1"
        self.r: Any = redis.Redis.from_url(self.url)
        wait(lambda: self._ping(), 10, "redis-server")
        self.keys = Keys()
        self.data = work / "data"
        rng = np.random.default_rng(0)
        write_shard(self.data / "tiny" / "train_000.bin", rng.integers(0, 256, 400_000))
        self.runs = work / "runs"
        self.cfg = dict(CFG, steps=steps)
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "TRAINQ_REDIS_URL": self.url, "TRAINQ_BROKER_URL": self.broker,
            "TRAINQ_DATA_ROOT": str(self.data), "TRAINQ_RUNS_ROOT": str(self.runs),
            "TRAINQ_CANCEL_GRACE_S": "10",
        })  # fmt: skip
        self.log = (work / "worker.log").open("wb")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "--queues", "cpu", "--slots", "1",
             "--hostname", "bench"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=REPO,
        )  # fmt: skip
        wait(lambda: self.r.hget(self.keys.workers, "bench"), 60, "the worker", 0.1)
        self.sender = Celery(broker=self.broker)
        self.sender.connection_for_write().ensure_connection()

    def _ping(self) -> bool:
        try:
            return bool(self.r.ping())
        except redis.ConnectionError:
            return False

    def submit(
        self, procs: int, train: dict[str, Any], job: str | None = None, **kw: Any
    ) -> tuple[str, float]:
        job = job or f"b{uuid.uuid4().hex[:10]}"
        msg = JobMessage.model_validate(
            {"job_id": job, "attempt": 1, "queue": "cpu", "procs_per_node": procs,
             "train": train, **kw}
        )  # fmt: skip
        t0 = time.time()
        self.sender.send_task(TASK_NAME, args=[msg.to_json()], queue="cpu")
        return job, t0

    def events(self, job: str) -> list[tuple[float, Event]]:
        return [(int(i.split(b"-")[0]) / 1000, Event.from_fields(f))
                for i, f in self.r.xrange(self.keys.job(job))]  # fmt: skip

    def exited(self, job: str, timeout: float = 300) -> dict[str, Any]:
        """The job's exit event, read with a blocking XREAD from where the last read ended.

        Not by polling the whole stream: re-reading and parsing every metric so far, 20 times
        a second, cost the bench several ms of CPU per step, taken from the very run it timed
        (the bare side waits in subprocess.run and costs nothing).
        """
        key, last = self.keys.job(job), "0-0"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, entries in self.r.xread({key: last}, count=1000, block=1000) or ():
                for entry_id, fields in entries:
                    last = entry_id
                    e = Event.from_fields(fields)
                    if e.kind == "lifecycle" and e.data["phase"] == "exited":
                        return e.data
        raise SystemExit(f"bench: timed out waiting for {job} to exit")

    def close(self) -> None:
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.worker.pid, signal.SIGKILL)
        self.log.close()
        self.redis_proc.terminate()
        self.redis_proc.wait(10)

    # --- 1 ---------------------------------------------------------------------------------
    def cancel(self, job: str) -> None:
        self.r.set(self.keys.cancel(job), "1")
        self.r.publish(self.keys.cancel_channel(), job)

    def lifecycle_ts(self, job: str, phase: str) -> float:
        """The worker's time stamp on the job's ``phase`` lifecycle event."""
        return next(e.ts for _, e in self.events(job)
                    if e.kind == "lifecycle" and e.data["phase"] == phase)  # fmt: skip

    def dispatch_sample(self) -> tuple[float, float]:
        boot = boot_time()
        job, t0 = self.submit(1, dict(self.cfg, steps=100_000))
        run_dir = self.runs / job
        pid = wait(lambda: find_torchrun(run_dir), 30, "torchrun", 0.001)
        t_torchrun = start_time(pid, boot)
        self.cancel(job)
        self.exited(job)
        return self.lifecycle_ts(job, "running") - t0, t_torchrun - t0

    def handoff_sample(self) -> float:
        """A task queued behind a busy slot: from the end of the run before it (its exit
        event) to its own launch (its running event), both stamped by the worker."""
        first, _ = self.submit(1, dict(self.cfg, steps=20))
        wait(lambda: find_torchrun(self.runs / first), 30, "torchrun", 0.01)
        second, _ = self.submit(1, dict(self.cfg, steps=100_000))  # waits for the slot
        self.exited(first)
        wait(lambda: find_torchrun(self.runs / second), 30, "torchrun", 0.01)
        self.cancel(second)
        self.exited(second)
        return self.lifecycle_ts(second, "running") - self.lifecycle_ts(first, "exited")

    # --- 2 and 3 ----------------------------------------------------------------------------
    def worker_run(self) -> tuple[float, float, Path, dict[str, float]]:
        """(submit -> first metric on the wire, last step -> exit event, run dir, CPU)."""
        job = f"b{uuid.uuid4().hex[:10]}"
        cpu = RunCPU(self.runs / job, {"worker": self.worker.pid, "redis": self.redis_proc.pid})
        job, t0 = self.submit(2, self.cfg, job=job)
        done = self.exited(job)
        assert done["reason"] is None, done
        first = next(t for t, e in self.events(job) if e.kind == "metric")
        run_dir = self.runs / job
        end = self.lifecycle_ts(job, "exited") - metric_times(run_dir)[-1]
        return first - t0, end, run_dir, cpu.stop()

    def bare_argv(self, run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "-m", "trainer", "--config", str(run_dir / "config.json"),
                "--run-dir", str(run_dir), "--data-root", str(self.data)]  # fmt: skip

    def bare_env(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if not k.startswith("TRAINQ_")}

    def bare_run(self, i: int) -> tuple[float, float, Path, dict[str, float]]:
        """(Popen -> first step, last step -> torchrun exited, run dir, CPU)."""
        run_dir = self.work / f"bare-{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(self.cfg))
        cpu = RunCPU(run_dir)
        t0 = time.time()
        subprocess.run(
            self.bare_argv(run_dir), env=self.bare_env(), check=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        end = time.time()
        times = metric_times(run_dir)
        return times[0] - t0, end - times[-1], run_dir, cpu.stop()

    # --- 4 ----------------------------------------------------------------------------------
    def interleaved(
        self, slices: int, slice_s: float, warmup: int, bare_first: bool, tag: str = ""
    ) -> tuple[float, float, dict[str, float]]:
        """Throughput (tok/s) of a worker run and a bare torchrun run that take turns.

        Both run at once, but only one trains at a time: the other's processes are held with
        SIGSTOP, and every ``slice_s`` they swap (SIGCONT/SIGSTOP), ``slices`` times each in
        alternating order. So both sides see the same machine, minute by minute, where runs
        one after the other saw its speed drift by 10-20 %. Only steps that began and ended
        inside one of their side's slices count. ``bare_first``: which side starts first
        (an A/A check found the second one ~1 % slower; main() runs both orders).

        Also returns CPU ms per step within the turns: of each side's ranks, of its torchrun
        (and guard), and of the worker process and redis-server in the worker's turns less
        in the bare's (what the worker path adds while it trains; the bench's own XREAD for
        the exit is not running then, it waits after the turns).
        """
        cfg = dict(self.cfg, steps=1_000_000)
        tps = tokens_per_step(cfg)
        b_dir = self.work / f"bare-interleaved-{int(bare_first)}{tag}"
        b_dir.mkdir(parents=True)
        (b_dir / "config.json").write_text(json.dumps(cfg))
        job = f"b{uuid.uuid4().hex[:10]}"
        w_dir = self.runs / job
        bare: subprocess.Popen[bytes] | None = None
        # Each side's processes (found once it trains) and their role, ranks or launch.
        roles: dict[str, dict[int, str]] = {"worker": {}, "bare": {}}

        def start(side: str) -> None:
            nonlocal bare
            if side == "worker":
                self.submit(2, cfg, job=job)
            else:
                bare = subprocess.Popen(
                    self.bare_argv(b_dir), env=self.bare_env(), stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            run_dir = w_dir if side == "worker" else b_dir
            wait(lambda: metric_count(run_dir) >= warmup, 120, f"the {side} run's steps", 0.05)
            roles[side] = {pid: role_of(cmd) for pid, cmd in run_processes(run_dir)}
            signal_pids(roles[side], signal.SIGSTOP)

        try:
            for side in ("bare", "worker") if bare_first else ("worker", "bare"):
                start(side)
            windows: dict[str, list[tuple[float, float]]] = {"worker": [], "bare": []}
            shared = {"worker": self.worker.pid, "redis": self.redis_proc.pid}
            cpu: dict[str, dict[str, float]] = {"worker": {}, "bare": {}}
            steps = {"worker": 0, "bare": 0}

            def charge(side: str, sign: float) -> None:
                for pid, role in roles[side].items():
                    cpu[side][role] = cpu[side].get(role, 0.0) + sign * cpu_s(pid)
                for name, pid in shared.items():
                    cpu[side][name] = cpu[side].get(name, 0.0) + sign * cpu_s(pid)

            for k in range(slices):
                for side in ("worker", "bare") if k % 2 == 0 else ("bare", "worker"):
                    run_dir = w_dir if side == "worker" else b_dir
                    n0 = metric_count(run_dir)
                    charge(side, -1)
                    t0 = time.time()
                    signal_pids(roles[side], signal.SIGCONT)
                    time.sleep(slice_s)
                    signal_pids(roles[side], signal.SIGSTOP)
                    windows[side].append((t0, time.time()))
                    charge(side, +1)
                    steps[side] += metric_count(run_dir) - n0
        finally:
            signal_pids(roles["bare"], signal.SIGKILL)
            if bare is not None:
                bare.kill()
                bare.wait()
            signal_pids(roles["worker"], signal.SIGCONT)
            self.cancel(job)
            self.exited(job)
        per_step = {
            f"{side} {role}": 1000 * cpu[side][role] / steps[side]
            for side in ("worker", "bare")
            for role in ("ranks", "launch")
        }
        for name in shared:  # what they spend in the worker's turns beyond the bare's
            per_step[name] = 1000 * (cpu["worker"][name] - cpu["bare"][name]) / steps["worker"]
        return (
            windowed_throughput(w_dir, windows["worker"], tps),
            windowed_throughput(b_dir, windows["bare"], tps),
            per_step,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--slices", type=int, default=30, help="interleaved slices per side")
    p.add_argument("--slice-s", type=float, default=1.0)
    p.add_argument("--pairs", type=int, default=1, help="interleaved runs in both orders")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainq-bench-") as tmp:
        b = Bench(Path(tmp), a.steps)
        try:
            guard, torchrun = [], []
            b.dispatch_sample()  # warm: first imports in the worker process
            for _ in range(a.samples):
                g, t = b.dispatch_sample()
                guard.append(g * 1000)
                torchrun.append(t * 1000)
                time.sleep(0.2)  # an idle worker: nothing in flight
            print(
                f"submit -> guard exec     p50 {pct(guard, 0.5):6.1f} ms  "
                f"p90 {pct(guard, 0.9):6.1f} ms  (n={len(guard)})"
            )
            print(
                f"submit -> torchrun exec  p50 {pct(torchrun, 0.5):6.1f} ms  "
                f"p90 {pct(torchrun, 0.9):6.1f} ms  (10 ms clock; goal p50 <= 50 ms)"
            )

            handoff = [1000 * b.handoff_sample() for _ in range(max(3, a.samples // 3))]
            print(
                f"queued behind a busy slot: previous exit -> launch  p50 "
                f"{pct(handoff, 0.5):6.1f} ms  max {max(handoff):6.1f} ms  (n={len(handoff)})"
            )

            tps = tokens_per_step(b.cfg)
            first_w, first_b, tput_w, tput_b = [], [], [], []
            end_w: list[float] = []
            end_b: list[float] = []
            cpu_w: list[dict[str, float]] = []
            cpu_b: list[dict[str, float]] = []
            for i in range(a.rounds):
                order = ("worker", "bare") if i % 2 == 0 else ("bare", "worker")
                for kind in order:
                    if kind == "worker":
                        f, e, d, c = b.worker_run()
                        first_w.append(f)
                        end_w.append(e)
                        tput_w.append(throughput(d, a.warmup, tps))
                        cpu_w.append(c)
                    else:
                        f, e, d, c = b.bare_run(i)
                        first_b.append(f)
                        end_b.append(e)
                        tput_b.append(throughput(d, a.warmup, tps))
                        cpu_b.append(c)
            fw, fb = statistics.median(first_w), statistics.median(first_b)
            tw, tb = statistics.median(tput_w), statistics.median(tput_b)
            print(
                f"first metric: worker {fw:.2f} s (submit -> on the wire), bare torchrun "
                f"{fb:.2f} s (Popen -> first step); ratio {fw / fb:.3f} (goal <= 1.2)"
            )
            paired = statistics.median(w / x for w, x in zip(tput_w, tput_b, strict=True))
            ew, eb = statistics.median(end_w), statistics.median(end_b)
            print(
                f"run end: last step -> exit event (worker) {ew:.2f} s, last step -> torchrun "
                f"exited (bare) {eb:.2f} s"
            )
            print(
                f"throughput: worker {tw:,.0f} tok/s, bare torchrun {tb:,.0f} tok/s; "
                f"ratio {tw / tb:.3f} (goal >= 0.98; medians of {a.rounds} rounds); median of "
                f"the per-round ratios (each pair run back to back) {paired:.3f}"
            )

            ratios, cpu_i = [], []
            for pair in range(a.pairs):
                for bare_first in (False, True):
                    iw, ib, c = b.interleaved(
                        a.slices, a.slice_s, a.warmup, bare_first, tag=f"-{pair}"
                    )
                    ratios.append(iw / ib)
                    cpu_i.append(c)
                    print(
                        f"throughput, interleaved ({'bare' if bare_first else 'worker'} run "
                        f"started first; {a.slices} x {a.slice_s:g} s turns each): worker "
                        f"{iw:,.0f} tok/s, bare torchrun {ib:,.0f} tok/s; ratio {iw / ib:.3f}"
                    )
            print(
                f"throughput, interleaved, both orders x {a.pairs}: ratio "
                f"{statistics.geometric_mean(ratios):.3f} (geometric mean; goal >= 0.98), "
                f"range {min(ratios):.3f} to {max(ratios):.3f}"
            )

            def med(key: str) -> float:
                return statistics.median(c[key] for c in cpu_i)

            print(
                f"CPU per step within the turns (medians): ranks worker {med('worker ranks'):.2f}"
                f" ms, bare {med('bare ranks'):.2f} ms, ratio "
                f"{med('worker ranks') / med('bare ranks'):.3f}; torchrun+guard worker "
                f"{med('worker launch'):.2f} ms, bare {med('bare launch'):.2f} ms; added in the "
                f"worker's turns: worker process {med('worker'):.2f} ms, redis-server "
                f"{med('redis'):.2f} ms"
            )

            def per_step(runs: list[dict[str, float]], role: str) -> float:
                return 1000 * statistics.median(r.get(role, 0.0) for r in runs) / a.steps

            rw, rb = per_step(cpu_w, "ranks"), per_step(cpu_b, "ranks")
            print(
                f"CPU per step (medians; noise-robust where wall time is not): ranks "
                f"worker {rw:.2f} ms, bare {rb:.2f} ms, ratio {rw / rb:.3f}; beside the ranks: "
                f"torchrun+guard worker {per_step(cpu_w, 'launch'):.2f} ms, bare "
                f"{per_step(cpu_b, 'launch'):.2f} ms; worker process "
                f"{per_step(cpu_w, 'worker'):.2f} ms; redis-server "
                f"{per_step(cpu_w, 'redis'):.2f} ms"
            )
            print(
                "per round (worker, bare) tok/s:",
                ", ".join(f"({w:,.0f}, {x:,.0f})" for w, x in zip(tput_w, tput_b, strict=True)),
            )
        finally:
            b.close()


if __name__ == "__main__":
    main()
