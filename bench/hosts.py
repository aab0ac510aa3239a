"""Multi-node training across separate network hosts (Linux network namespaces, root only).

Three hosts from ``tests/hosts.py`` (namespaces on a bridge, Redis reached through a relay
per host), PostgreSQL, Redis and the API in the root namespace, a fresh store (``stack()``).

1. Tokens/s of one 2-node x 2-rank job (the trainer's own ``tokens_per_s``), three ways:
   - ``hosts``: through the service, one node on each of two namespace hosts;
   - ``one``: through the service, both nodes on one host (two workers in the root
     namespace, rendezvous on loopback);
   - ``bare``: ``torchrun --nnodes 2`` started by hand in the same two namespaces (static
     rendezvous at host 0's address, the same trainer, config and data; no worker).
   This machine's speed drifts by 10-30% over seconds to minutes (a VM's neighbours: one
   long bare run here went from 10.5k to 14.3k tokens/s and back within minutes, with no
   steal time reported), more than the differences measured. So the three jobs run at once
   and take the machine in turns: each is started alone and held (SIGSTOP to its torchrun
   agents and ranks) once it steps; then, for ``--cycles``, each in turn runs ``--window``
   seconds while the others are held (one hosts bare / bare hosts one / ...). A turn's
   rate is the median of the steps logged from 1 s after it began; each ratio is taken per
   cycle, between turns next to each other, and reported as the median over the cycles
   with a 90% bootstrap interval of that median. ``--aa`` adds a second bare job: bare /
   bare2 shows what the method resolves (1 should lie inside its interval). Beside it, the
   CPU the service's own processes (API, PostgreSQL, Redis, workers, the relays) used
   during each side's turns, as a share of the machine. Goals: hosts/one >= 0.95,
   hosts/bare >= 0.98. The service runs with its default settings here: the test-speed
   ones part 2 needs make the API and PostgreSQL poll several times as often, CPU taken
   from the ranks on this machine and from nobody's on a cluster (the API has its own
   host).
2. Time from a host's loss (every process in it killed, its link down) to the job running
   again on the remaining hosts: to attempt 2's start, and to its first step; printed with
   the heartbeat TTL + grace. Goal: <= grace + 10 s. A fresh API and workers with test-speed
   settings (a 3 s heartbeat TTL, a reconcile pass every 0.5 s).

   Then a timeline: the first event of each kind per attempt and node (lifecycle phases,
   logs, the first metric), seconds after the loss (``--log-lines``: attempt 2's lines too).

``python bench/hosts.py [--cycles 30] [--window 6] [--aa] [--loss-only] [--log-lines]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._util import (
    CORES,
    Stack,
    cpu_seconds,
    postgres_pids,
    stack,
    start_worker,
    stop_worker,
)
from tests.hosts import Host, Hosts, available
from trainer.events import Event
from trainer.prepare import prepare_demo

FAST = {
    "TRAINQ_HEARTBEAT_TTL_S": "3",
    "TRAINQ_HEARTBEAT_GRACE_S": "1",
    "TRAINQ_RECONCILE_INTERVAL_S": "0.5",
    "TRAINQ_CANCEL_GRACE_S": "5",
    "TRAINQ_CANCEL_POLL_S": "0.5",
    "TRAINQ_REGISTRY_INTERVAL_S": "1",
    "TRAINQ_INGEST_BLOCK_MS": "200",
    "TRAINQ_GANG_TIMEOUT_S": "60",
}
HOSTS_Q, ONE_Q = "bench-hosts", "bench-one"


def train(steps: int) -> dict[str, Any]:
    return {
        "steps": steps,
        "seed": 7,
        "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 256},
        "data": {"path": "demo"},
        "batch": {"micro_batch_size": 8},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "eval": {"every": 0},
        "checkpoint": {"every": 0, "keep": 1},
        "log_every": 1,
    }


def wait(pred: Any, timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        time.sleep(every)
    return value


FOREVER = 1_000_000  # steps: a comparison's jobs run until it finishes them
SETTLE_S = 1.0  # of a turn, before its steps count


def process_tree(roots: list[int]) -> list[int]:
    """``roots`` and every process descended from them (from /proc, at this moment)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def run_processes(parents: list[int]) -> list[int]:
    """Every process of the runs below ``parents``: the torchrun agents (plain torchrun, or
    the worker's ``trainer.torchrun``) and their ranks. Walked, not taken as a process group:
    torchrun starts each rank in a session of its own (torch's SubprocessHandler)."""
    agents = []
    for pid in process_tree(parents):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] in ([b"-m", b"torch.distributed.run"], [b"-m", b"trainer.torchrun"]):
            agents.append(pid)
    assert len(agents) == 2, f"torchrun agents {agents}"
    return process_tree(agents)


@dataclass
class Side:
    """One 2-node x 2-rank job of the comparison, running until ``finish``. ``hold`` stops
    every process of the run (SIGSTOP to the torchrun agents and their ranks, found once
    when it starts stepping) while another side has the machine; ``go`` lets it on again.
    The job's own step records say what it did while it ran (``records``: step, time,
    tokens_per_s)."""

    name: str
    pids: list[int]  # the run's torchrun agents and ranks
    records: Callable[[], list[dict[str, Any]]]
    finish: Callable[[], None]
    windows: list[tuple[float, float]] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)  # the service's, per window

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def hold(self) -> None:
        self.signal(signal.SIGSTOP)

    def go(self) -> None:
        self.signal(signal.SIGCONT)

    def rates(self, settle: float) -> list[float | None]:
        """Per window: the median tokens/s of the steps logged from ``settle`` s after it
        began to its end (the first step after a hold spans the hold; the next ones warm
        the caches again), None for a window with fewer than 3 such steps."""
        recs = [(float(r.get("time") or r["ts"]), r["tokens_per_s"]) for r in self.records()
                if r.get("tokens_per_s")]  # fmt: skip
        out: list[float | None] = []
        for t0, t1 in self.windows:
            inside = [rate for t, rate in recs if t0 + settle <= t <= t1]
            out.append(statistics.median(inside) if len(inside) >= 3 else None)
        return out


class Bench:
    def __init__(self, st: Stack, hosts: Hosts, settings: dict[str, str], tag: str) -> None:
        self.st, self.hosts, self.tag = st, hosts, tag
        self.log_lines = False  # print attempt 2's log lines in the timeline
        self.api = st.serve_api(1, **settings)
        self.client = httpx.Client(base_url=self.api.url, headers=st.auth, timeout=30)
        self.workers: dict[str, Any] = {}
        self.on: dict[str, Host] = {}
        self.env = st.env(**settings)
        self.env.pop("TRAINQ_DATABASE_URL")

    def close(self) -> None:
        """Every worker stopped, then the API: the next part starts its own."""
        for proc in self.workers.values():
            if proc.poll() is None:
                stop_worker(proc)
        self.client.close()
        self.api.stop()
        self.st.servers.remove(self.api)

    def service_cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the service's long-lived processes: what a run through
        the service costs beyond its ranks and torchrun (the bare side runs these too, idle)."""
        redis = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True)
        return {
            "api": self.api.cpu_s(),
            "postgres": cpu_seconds(postgres_pids()),
            "redis": cpu_seconds([int(p) for p in redis.stdout.split()]),
            "workers": cpu_seconds([p.pid for p in self.workers.values() if p.poll() is None]),
            # this process: the hosts' Redis relays (tests/hosts.Forwarder) and the polling
            "relays": time.process_time(),
        }

    def registered(self, name: str) -> bool:
        listed = self.client.get("/v1/workers").json()["items"]
        return any(w["name"] == name for w in listed)

    def host_worker(self, host: Host) -> str:
        name = f"b{self.tag}-{host.netns}"
        env = dict(self.env)
        for var in ("TRAINQ_REDIS_URL", "TRAINQ_BROKER_URL"):
            env[var] = self.hosts.redis_url(host, int(env[var].rsplit("/", 1)[1]))
        argv = [sys.executable, "-m", "worker", "--queues", HOSTS_Q, "--hostname", name]
        self.workers[name] = host.popen(argv, env, self.st.tmp / f"{name}.log")
        self.on[name] = host
        wait(lambda: self.registered(name), 90, f"worker {name}")
        return name

    def local_worker(self, i: int) -> str:
        name = f"b{self.tag}-local{i}"
        self.workers[name] = start_worker(self.env, ONE_Q, name, self.st.tmp / f"{name}.log")
        wait(lambda: self.registered(name), 90, f"worker {name}")
        return name

    def submit(self, queue: str, cfg: dict[str, Any], **spec: Any) -> str:
        body = {"name": queue, "queue": queue, "train": cfg, "nodes": 2, "procs_per_node": 2}
        r = self.client.post("/v1/jobs", json={**body, **spec})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.client.get(f"/v1/jobs/{job_id}").json())

    def points(self, job_id: str) -> list[dict[str, Any]]:
        r = self.client.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 100_000})
        return list(r.json()["points"])

    def service_side(self, name: str, queue: str, workers: list[str]) -> Side:
        """A job through the service on ``queue`` (served by ``workers``), once it steps."""
        job_id = self.submit(queue, train(FOREVER))

        def finish() -> None:
            self.client.post(f"/v1/jobs/{job_id}/cancel")
            wait(lambda: self.job(job_id)["status"] in ("cancelled", "failed"), 120, job_id)

        wait(lambda: len(self.points(job_id)) > 5, 600, f"{name}: 6 steps", 1.0)
        pids = run_processes([self.workers[w].pid for w in workers])
        return Side(name, pids, lambda: self.points(job_id), finish)

    def bare_side(self, name: str, n: int) -> Side:
        """``torchrun --nnodes 2`` by hand in host 0 and host 1: the same trainer, config and
        data, no worker (static rendezvous at host 0's address), once it steps."""
        h0, h1 = self.hosts.hosts[0], self.hosts.hosts[1]
        run = self.st.tmp / f"bare-{n}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps(train(FOREVER)))
        port = 29400 + n
        env = {k: v for k, v in self.env.items() if not k.startswith("TRAINQ_")}
        env.update(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS=self.env.get("OMP_NUM_THREADS", "1"))
        procs = []
        for rank, host in enumerate((h0, h1)):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc-per-node=2", "--rdzv-backend=static",
                    f"--rdzv-endpoint={h0.address}:{port}", f"--node-rank={rank}",
                    "-m", "trainer", "--config", str(run / "config.json"),
                    "--run-dir", str(run), "--data-root", str(self.st.tmp / "data")]  # fmt: skip
            procs.append(host.popen(argv, env, run / f"node{rank}.log", cwd=run))

        def records() -> list[dict[str, Any]]:
            with contextlib.suppress(FileNotFoundError):
                lines = (run / "metrics.jsonl").read_text().splitlines()
                return [r for ln in lines if "step" in (r := json.loads(ln))]
            return []

        def finish() -> None:
            for p in procs:  # torchrun passes the signal on to its ranks
                p.terminate()
            for p in procs:
                p.wait(60)

        def stepping() -> bool:
            assert all(p.poll() is None for p in procs), (run / "node0.log").read_text()[-2000:]
            return len(records()) > 5

        wait(stepping, 600, f"{name}: 6 steps", 1.0)
        return Side(name, run_processes([p.pid for p in procs]), records, finish)

    def host_loss(self) -> tuple[float, float, float]:
        """(s to attempt 1 lost, s to attempt 2 started, s to its first step) after the loss."""
        cfg = {**train(100_000), "checkpoint": {"every": 10, "keep": 1}}
        job_id = self.submit(HOSTS_Q, cfg, retries=1)
        wait(lambda: len(self.points(job_id)) >= 15, 300, "training", 0.2)
        events = self.lifecycle_workers(job_id)
        victim = self.on[events[1]]
        t0 = time.time()
        victim.kill_all()
        victim.link(False)

        def second_started() -> dict[str, Any] | None:
            j = self.job(job_id)
            return j if j["attempt"] == 2 and j["attempts"][1]["started_at"] else None

        job = wait(second_started, 120, "attempt 2", 0.05)
        lost = datetime.fromisoformat(job["attempts"][0]["ended_at"]).timestamp() - t0
        started = datetime.fromisoformat(job["attempts"][1]["started_at"]).timestamp() - t0
        first = wait(
            lambda: [p for p in self.points(job_id) if p["attempt"] == 2], 300, "a step", 0.05
        )
        stepped = min(p["ts"] for p in first) - t0
        self.client.post(f"/v1/jobs/{job_id}/cancel")
        victim.link(True)
        self.timeline(job_id, t0)
        return lost, started, stepped

    def timeline(self, job_id: str, t0: float) -> None:
        """Where the time from the loss to attempt 2's first step went: the first event of
        each kind (lifecycle phase, log, metric) per attempt and node, seconds after the loss."""
        import redis

        r = redis.Redis.from_url(self.st.redis_url)
        try:
            entries = r.xrange(f"trainq:job:{job_id}")
        finally:
            r.close()
        seen: dict[tuple[int, str, int], float] = {}
        for _, f in entries:
            ev = Event.from_fields(f)
            if ev.ts < t0:
                continue
            what = ev.kind
            if ev.kind == "lifecycle":
                what = f"lifecycle {ev.data.get('phase')}"
            elif ev.kind == "log":
                what = f"log ({ev.source})"
            key = (ev.attempt, what, int(ev.data.get("node", 0)))
            seen.setdefault(key, ev.ts - t0)
            if self.log_lines and ev.kind == "log" and ev.attempt > 1:
                for line in ev.data.get("lines", [])[:40]:
                    print(f"     {ev.ts - t0:6.1f} s  {ev.source}: {str(line)[:150]}")
        print("   timeline after the loss (first event of a kind, per attempt and node):")
        for (attempt, what, node), s in sorted(seen.items(), key=lambda kv: kv[1]):
            print(f"     {s:6.1f} s  attempt {attempt} node {node}: {what}")

    def lifecycle_workers(self, job_id: str) -> dict[int, str]:
        import redis

        r = redis.Redis.from_url(self.st.redis_url)
        try:
            entries = r.xrange(f"trainq:job:{job_id}")
        finally:
            r.close()
        out = {}
        for _, f in entries:
            data = json.loads(f[b"data"])
            if f[b"kind"] == b"lifecycle" and data.get("phase") == "running":
                out[int(data.get("node", 0))] = data["worker"]
        return out


def throughput(st: Stack, hosts: Hosts, cycles: int, window: float, aa: bool) -> None:
    """Part 1: tokens/s through the service across two hosts, on one host, and bare, the
    three jobs running at once and taking the machine in turns."""
    # Part 1 runs the service as deployed (its default settings): the test-speed ones
    # (a reconcile pass every 0.5 s, an ingest read every 0.2 s, a registry refresh every
    # second) cost the API and PostgreSQL CPU that the ranks share here and would not on
    # a cluster, where the API has a host of its own. Part 2 needs them: it times a loss.
    b = Bench(st, hosts, {}, "1")
    sides: list[Side] = []
    try:
        hosted = [b.host_worker(host) for host in hosts.hosts[:2]]
        local = [b.local_worker(i) for i in range(2)]
        # Turns go one, hosts, bare (, bare2) / back: each ratio's two sides are next to
        # each other in every cycle, seconds apart.
        starts = [
            lambda: b.service_side("one", ONE_Q, local),
            lambda: b.service_side("hosts", HOSTS_Q, hosted),
            lambda: b.bare_side("bare", 0),
        ]
        if aa:
            starts.append(lambda: b.bare_side("bare2", 1))
        for start in starts:  # one at a time: no side's start-up is measured, nor slowed
            sides.append(start())
            sides[-1].hold()
        for c in range(cycles):
            for side in sides if c % 2 == 0 else reversed(sides):
                side.go()
                before, t0 = b.service_cpu(), time.time()
                time.sleep(window)
                t1, after = time.time(), b.service_cpu()
                side.hold()
                side.windows.append((t0, t1))
                side.cpu.append({k: (after[k] - before[k]) / (t1 - t0) / CORES for k in before})
        time.sleep(3)  # the last window's steps reach the store (the ingestor's linger)
        rates = {side.name: side.rates(SETTLE_S) for side in sides}
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                side.go()
                side.finish()
        b.close()
    print(f"\n1. 2 nodes x 2 ranks, tokens/s, the jobs running at once and taking turns:"
          f" {cycles} cycles of {window:g} s each (median of the steps logged {SETTLE_S:g} s"
          f" after a turn began), default settings:")  # fmt: skip
    for name, turns in rates.items():
        got = [x for x in turns if x is not None]
        print(f"   {name:5s}: median {statistics.median(got):,.0f}, turns {min(got):,.0f}"
              f" to {max(got):,.0f} ({len(got)} of {len(turns)} with 3 steps or more)")  # fmt: skip
    pairs = [("hosts", "one", 0.95), ("hosts", "bare", 0.98)]
    if aa:
        pairs.append(("bare", "bare2", 1.0))
    for a, other, goal in pairs:
        per: list[float] = [x / y for x, y in zip(rates[a], rates[other], strict=True) if x and y]
        r = statistics.median(per)
        lo, hi = interval(per)
        if (a, other) == ("bare", "bare2"):
            verdict = f"the same job twice: {'1 inside' if lo <= 1 <= hi else '1 OUTSIDE'}"
        else:
            verdict = f"goal >= {goal}: {'ok' if r >= goal else 'MISS'}"
        print(f"   {a} / {other:5s} per cycle: median {r:.3f} (90% interval of the median"
              f" {lo:.3f}-{hi:.3f}, {len(per)} cycles; per cycle {min(per):.3f} to"
              f" {max(per):.3f})  {verdict}")  # fmt: skip
    print("   the service's CPU during a side's turns, % of the machine (median over turns):")
    for side in sides:
        share = {p: statistics.median(c[p] for c in side.cpu) for p in side.cpu[0]}
        parts = ", ".join(f"{p} {100 * x:.2f}" for p, x in share.items())
        print(f"   {side.name:5s}: {100 * sum(share.values()):.2f} ({parts})")


def interval(values: list[float], n: int = 2000, seed: int = 7) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of ``values`` (resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[n // 20], meds[n - 1 - n // 20]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=30, help="part 1: turns of every side")
    p.add_argument("--window", type=float, default=6.0, help="part 1: seconds of one turn")
    p.add_argument("--aa", action="store_true", help="part 1: a second bare side, bare/bare2")
    p.add_argument("--loss-only", action="store_true", help="part 2 alone")
    p.add_argument("--log-lines", action="store_true", help="part 2: attempt 2's log lines")
    a = p.parse_args()
    why = available()
    if why is not None:
        sys.exit(f"bench/hosts.py: {why}")
    print(f"note: {CORES} cores shared by every rank, worker, the API, PostgreSQL and Redis;"
          " the namespace hosts share these CPUs (what differs is the network path)")  # fmt: skip
    with stack(owner="bench-hosts") as st, Hosts(3) as hosts:
        prepare_demo(st.tmp / "data" / "demo")
        if not a.loss_only:
            throughput(st, hosts, a.cycles, a.window, a.aa)
        b = Bench(st, hosts, FAST, "2")
        b.log_lines = a.log_lines
        try:
            for host in hosts.hosts:
                b.host_worker(host)
            grace = float(FAST["TRAINQ_HEARTBEAT_TTL_S"]) + float(FAST["TRAINQ_HEARTBEAT_GRACE_S"])
            lost, started, stepped = b.host_loss()
        finally:
            b.close()
        print(f"\n2. host lost (heartbeat ttl + grace = {grace:g} s, test-speed settings):"
              f" attempt 1 lost after {lost:.1f} s; the job running again (attempt 2 started)"
              f" after {started:.1f} s (goal <= grace + 10 = {grace + 10:g} s:"
              f" {'ok' if started <= grace + 10 else 'MISS'}); its first step after"
              f" {stepped:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
