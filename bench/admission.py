"""The admitter (issue 16): decision time, submit -> exec, and draining a backlog, with the
fifo scheduler (every submit sent at once to the queue's shared Celery list) beside it.

    .venv/bin/python bench/admission.py [--decide] [--exec] [--drain]  (none given: all three)
        [--jobs 10000] [--passes 20] [--samples 10] [--drain-jobs 200] [--drain-rounds 1]

1. Decision time. 10,000 queued jobs of 50 owners (priorities -1..2, one in ten a 2-node
   gang, 1-4 ranks per node) on 4 queues, 100 workers of 2 slots (each serving 2 queues),
   and ~180 placed attempts (some gangs) holding all but 10 of the 200 slots.
   (a) ``decide()`` alone on those plain values, ``--passes`` times;
   (b) ``Admitter.run_once()`` against the real stores: the same jobs and attempts inserted
   in bulk into a fresh PostgreSQL database (the admitter reads every queued job of its
   database, so a shared one would mix in other runs' jobs), the 100 registry entries
   written to ``{prefix}:workers`` under a unique prefix, the tables analyzed (as
   autovacuum soon would; unanalyzed, the planner joins the 10k rows by a nested loop).
   The first pass places what fits in the 10 free slots and sends it (reported apart);
   the ``--passes`` after it find no free slot, so they time the decision, not the sends.
   ``Admitter.last`` splits each pass into read (registry, held and queued rows, caps),
   prepare (rows to values, fair-share use), decide and act (commit, send, preempt,
   pending reasons). Goal: <= 20 ms a pass.
2. Submit -> torchrun exec on an idle worker (``POST /v1/jobs`` to the torchrun process's
   start time in /proc, 10 ms clock, as bench/dispatch.py finds it), fifo and admit side by
   side: two stacks (each its own database, Redis numbers, API and one worker), samples
   alternated. Goal: admit p50 <= 50 ms.
3. Drain: ``--drain-jobs`` one-step jobs submitted at once to 4 one-slot workers, from the
   first submit to the last job's end (``ended_at``), fifo and admit alternated
   ``--drain-rounds`` times. Goal: admit / fifo <= 1.05.

Each API runs with the reconciler on (the admitter's thread runs only then); fifo with
TRAINQ_SCHEDULER=fifo, admit with TRAINQ_SCHEDULER=admit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
import redis
import sqlalchemy as sa
from _util import (
    REPO,
    SHARED_CORES_NOTE,
    Stack,
    fresh_pg,
    percentiles,
    stack,
)
from dispatch import CFG, boot_time, find_torchrun, start_time, wait

from service.api.core.db import make_engine, make_sessionmaker
from service.api.core.models import ATTEMPTS, JOBS
from service.api.core.settings import Settings
from service.api.scheduling.admit import Admitter
from service.api.scheduling.decide import Held, Waiting, Worker, decide
from service.api.scheduling.dispatch import Dispatcher
from tests.conftest import RedisDBs
from trainer.data import write_shard

QUEUES = ["q0", "q1", "q2", "q3"]
BENCH_QUEUE = "bench"
ENDLESS = dict(CFG, steps=100_000)
ONE_STEP = dict(CFG, steps=1)
TERMINAL = ("succeeded", "failed", "cancelled")


def goal(ok: bool) -> str:
    return "meets" if ok else "BELOW"


# --- 1. decision time -----------------------------------------------------------------------


@dataclass
class Scenario:
    """The cluster of part 1, as rows (for SQL and the registry) and as plain values."""

    prefix: str
    owner_prefix: str
    workers: list[dict[str, Any]]
    jobs: list[dict[str, Any]]  # queued ones
    held: list[dict[str, Any]]  # placed and running ones
    usage: dict[str, float]
    now: datetime

    def values(self) -> tuple[list[Worker], list[Waiting], list[Held]]:
        placed: dict[str, int] = {}
        for h in self.held:
            for name in h["placement"]:
                placed[name] = placed.get(name, 0) + 1
        workers = [
            Worker(w["name"], frozenset(w["queues"]), 2, 8, 0, 2 - placed.get(w["name"], 0))
            for w in self.workers
        ]
        waiting = [
            Waiting(j["id"], 1, j["owner"], j["queue"], j["nodes"], j["procs_per_node"],
                    j["priority"])
            for j in self.jobs
        ]  # fmt: skip
        held = [
            Held(h["id"], 1, h["owner"], h["queue"], h["nodes"], h["procs_per_node"],
                 h["priority"], h["placement"], self.now, None, "running")
            for h in self.held
        ]  # fmt: skip
        return workers, waiting, held


def scenario(n_jobs: int, owners: int = 50, n_workers: int = 100, free_slots: int = 10) -> Scenario:
    rng = random.Random(16)
    tag = uuid.uuid4().hex[:8]
    owner_prefix = f"admbench-{tag}-"
    now = datetime.now(UTC)
    base_ms = int(time.time() * 1000) - n_jobs - 1000
    seq = iter(range(10 * n_jobs))

    def job(owner: str, queue: str, nodes: int, procs: int, priority: int) -> dict[str, Any]:
        job_id = f"{base_ms + next(seq):012x}{rng.getrandbits(32):08x}"  # time-ordered
        return {"id": job_id, "owner": owner, "queue": queue, "nodes": nodes,
                "procs_per_node": procs, "priority": priority}  # fmt: skip

    workers = [
        {"name": f"w{i:03d}", "queues": [QUEUES[i % 4], QUEUES[(i + 1) % 4]]}
        for i in range(n_workers)
    ]
    names = [f"{owner_prefix}{k:02d}" for k in range(owners)]
    held: list[dict[str, Any]] = []
    slots = [(w, s) for w in workers for s in range(2)][: 2 * n_workers - free_slots]
    i = 0
    while i < len(slots):
        w = slots[i][0]
        gang = i % 20 == 0 and i + 1 < len(slots) and slots[i + 1][0] is w
        h = job(rng.choice(names), w["queues"][0], 2 if gang else 1, 8, rng.choice([-1, 0, 0, 1]))
        h["placement"] = [w["name"]] * h["nodes"]
        held.append(h)
        i += h["nodes"]
    jobs = [
        job(rng.choice(names), rng.choice(QUEUES), 2 if rng.random() < 0.1 else 1,
            rng.choice([1, 2, 4]), rng.choice([-1, 0, 0, 0, 0, 1, 2]))
        for _ in range(n_jobs)
    ]  # fmt: skip
    usage = {o: rng.uniform(0, 5000) for o in names}
    return Scenario(f"admbench{tag}", owner_prefix, workers, jobs, held, usage, now)


def bench_decide(sc: Scenario, passes: int) -> list[float]:
    times = []
    for _ in range(passes + 1):
        workers, waiting, held = sc.values()  # decide() consumes workers[].free
        t0 = time.perf_counter()
        plan = decide(workers, waiting, held, sc.usage, now=sc.now)
        times.append(time.perf_counter() - t0)
    print(
        f"  decide() plan: {len(plan.place)} placed, {len(plan.preempt)} preempted, "
        f"{sum(len(r) for r in plan.reasons.values())} reasons"
    )
    return times[1:]  # the first warms the caches


def insert_rows(pg_url: str, sc: Scenario) -> None:
    now = sc.now
    common = {"name": "admbench", "labels": {}, "max_runtime_s": None, "retries": 0,
              "train": ONE_STEP, "spec_hash": "0" * 64, "idempotency_key": None,
              "reason": None, "message": None, "attempt": 1, "retries_used": 0,
              "not_before": None, "preempted_at": None, "created_at": now, "started_at": None,
              "ended_at": None, "metric_attempt": None, "last_step": None,
              "last_metrics": None}  # fmt: skip
    jobs = [{**common, **{k: v for k, v in j.items() if k != "placement"}, "status": "queued"}
            for j in sc.jobs]  # fmt: skip
    jobs += [{**common, **{k: v for k, v in h.items() if k != "placement"}, "status": "running",
              "started_at": now} for h in sc.held]  # fmt: skip
    attempts = [{"job_id": j["id"], "number": 1, "status": "dispatched", "free": False,
                 "created_at": now, "sent_at": now, "placement": None}
                for j in sc.jobs]  # fmt: skip
    attempts += [{"job_id": h["id"], "number": 1, "status": "running", "free": False,
                  "created_at": now, "sent_at": now, "placement": h["placement"]}
                 for h in sc.held]  # fmt: skip
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(JOBS.insert(), jobs)
            conn.execute(ATTEMPTS.insert(), attempts)
        with engine.begin() as conn:  # as autovacuum would: else a nested loop over 10k rows
            conn.execute(sa.text("ANALYZE jobs"))
            conn.execute(sa.text("ANALYZE attempts"))
    finally:
        engine.dispose()


def entry(worker: dict[str, Any], running: list[str]) -> dict[str, Any]:
    """A CPU worker's registry entry, as worker.registry.Registry.entry() writes it."""
    return {"name": worker["name"], "host": "bench", "queues": worker["queues"], "slots": 2,
            "gpus": None, "gpu_memory_bytes": None, "slot_procs": 8, "gpus_per_slot": 0,
            "running": running, "busy": len(running), "draining": False,
            "ts": time.time()}  # fmt: skip


def write_registry(r: Any, sc: Scenario) -> None:
    running: dict[str, list[str]] = {}
    for h in sc.held:
        for name in h["placement"]:
            running.setdefault(name, []).append(h["id"])
    entries = {w["name"]: json.dumps(entry(w, running.get(w["name"], []))) for w in sc.workers}
    r.hset(f"{sc.prefix}:workers", mapping=entries)


def bench_run_once(sc: Scenario, passes: int) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(the first pass's timings and counts, the timings of the passes after it)."""
    dbs = RedisDBs()
    try:
        url = dbs.url(dbs.claim())
        with fresh_pg() as pg_url:
            settings = Settings(database_url=pg_url, redis_url=url, broker_url=url,
                                redis_prefix=sc.prefix)  # fmt: skip
            t0 = time.perf_counter()
            insert_rows(pg_url, sc)
            print(f"  inserted {len(sc.jobs) + len(sc.held)} jobs and attempts in "
                  f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
            r = redis.Redis.from_url(url)
            engine = make_engine(settings)
            try:
                admitter = Admitter(settings, make_sessionmaker(engine), r, Dispatcher(settings))
                write_registry(r, sc)
                done = admitter.run_once()
                first = dict(admitter.last, **(done or {}))
                runs = []
                for _ in range(passes):
                    write_registry(r, sc)  # fresh ts: never stale, whatever the pass time
                    done = admitter.run_once()
                    assert done is not None and done["placed"] == 0, done
                    runs.append(dict(admitter.last))
            finally:
                engine.dispose()
                with sa.create_engine(pg_url).begin() as conn:
                    conn.execute(sa.text("DELETE FROM jobs WHERE owner LIKE :p"),
                                 {"p": sc.owner_prefix + "%"})  # fmt: skip
                keys = list(r.scan_iter(match=f"{sc.prefix}*"))
                if keys:
                    r.delete(*keys)
                r.close()
    finally:
        dbs.release()
    return first, runs


def part_decide(a: argparse.Namespace) -> list[str]:
    sc = scenario(a.jobs)
    gangs = sum(j["nodes"] > 1 for j in sc.jobs)
    print(
        f"\n1. decision time: {len(sc.jobs)} queued jobs ({gangs} 2-node gangs) of 50 owners on "
        f"{len(QUEUES)} queues, {len(sc.workers)} workers x 2 slots, {len(sc.held)} placed "
        f"attempts holding {sum(h['nodes'] for h in sc.held)} slots"
    )
    d = percentiles(bench_decide(sc, a.passes))
    print(f"  (a) decide() alone: p50 {d['p50']:.1f} ms, p90 {d['p90']:.1f} ms (n={a.passes})")
    first, runs = bench_run_once(sc, a.passes)
    print(
        f"  (b) first pass (places into the 10 free slots, sends): {first['total_ms']:.1f} ms "
        f"(read {first['read_ms']:.1f}, prepare {first['prepare_ms']:.1f}, decide "
        f"{first['decide_ms']:.1f}, act {first['act_ms']:.1f}); placed {first['placed']}, "
        f"sent {first['sent']}, preempted {first['preempted']}"
    )
    split = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    total = percentiles([x["total_ms"] / 1000 for x in runs])
    print(
        f"  (b) run_once() with no free slot: total p50 {total['p50']:.1f} ms, p90 "
        f"{total['p90']:.1f} ms (n={len(runs)}); median split: read {split['read_ms']:.1f}, "
        f"prepare {split['prepare_ms']:.1f}, decide {split['decide_ms']:.1f}, act "
        f"{split['act_ms']:.1f} ms"
    )
    return [
        f"decide() alone, 10k jobs: p50 {d['p50']:.1f} ms p90 {d['p90']:.1f} ms "
        f"(goal <= 20 ms): {goal(d['p50'] <= 20)}",
        f"run_once() pass, 10k jobs: p50 {total['p50']:.1f} ms p90 {total['p90']:.1f} ms "
        f"(read {split['read_ms']:.1f} / prepare {split['prepare_ms']:.1f} / decide "
        f"{split['decide_ms']:.1f} / act {split['act_ms']:.1f}) (goal <= 20 ms): "
        f"{goal(total['p50'] <= 20)}",
    ]


# --- 2 and 3: the service with real workers -------------------------------------------------


@dataclass
class Side:
    """One scheduler's stack: its API and its workers, all serving BENCH_QUEUE."""

    mode: str
    stack: Stack
    api_url: str
    client: httpx.Client
    engine: sa.Engine
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def runs(self) -> Path:
        return self.stack.tmp / "runs"

    def add_workers(self, total: int) -> None:
        r = redis.Redis.from_url(self.stack.redis_url, decode_responses=True)
        try:
            for i in range(len(self.workers), total):
                name = f"{self.mode}-{i}"
                log = (self.stack.tmp / f"worker-{name}.log").open("wb")
                self.workers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "worker", "--queues", BENCH_QUEUE, "--slots",
                         "1", "--hostname", name],
                        env=self.stack.env(TRAINQ_CANCEL_GRACE_S="5"), stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                    )
                )  # fmt: skip
                wait(lambda n=name: r.hget("trainq:workers", n), 60, f"worker {name}", 0.1)
        finally:
            r.close()

    def submit(self, name: str, train: dict[str, Any]) -> str:
        resp = self.client.post("/v1/jobs", json={"name": name, "queue": BENCH_QUEUE,
                                                  "train": train})  # fmt: skip
        resp.raise_for_status()
        return str(resp.json()["id"])

    def status(self, job: str) -> str:
        return str(self.client.get(f"/v1/jobs/{job}").json()["status"])

    def exec_sample(self) -> float:
        """Seconds from just before the POST to the torchrun process's start."""
        boot = boot_time()
        t0 = time.time()
        job = self.submit("exec", ENDLESS)
        pid = wait(lambda: find_torchrun(self.runs / job), 60, "torchrun", 0.001)
        t = start_time(pid, boot) - t0
        self.client.post(f"/v1/jobs/{job}/cancel")
        wait(lambda: self.status(job) in TERMINAL, 60, f"{job} to end", 0.1)
        return t

    def drain(self, n: int, tag: str) -> tuple[float, dict[str, int]]:
        """(first submit -> last job's end, in s; the jobs by final status)."""
        t0 = datetime.now(UTC)
        for _ in range(n):
            self.submit(tag, ONE_STEP)
        q = sa.text("SELECT status, count(*), max(ended_at) FROM jobs WHERE name = :n "
                    "GROUP BY status")  # fmt: skip

        def finished() -> Any:
            with self.engine.connect() as conn:
                rows = conn.execute(q, {"n": tag}).all()
            done = sum(c for s, c, _ in rows if s in TERMINAL)
            return rows if done == n else None

        rows = wait(finished, 60 + 10 * n, f"{n} jobs of {tag} to end", 0.25)
        end = max(e for _, _, e in rows if e is not None)
        with self.engine.connect() as conn:
            for job_id, reason, message in conn.execute(
                sa.text("SELECT id, reason, message FROM jobs WHERE name = :n AND status <> "
                        "'succeeded'"), {"n": tag}
            ):  # fmt: skip
                print(f"  {self.mode}: job {job_id} {reason}: {str(message)[:300]}", flush=True)
        return (end - t0).total_seconds(), {s: c for s, c, _ in rows}

    def stop(self) -> None:
        for w in self.workers:
            w.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait(5)
        self.client.close()
        self.engine.dispose()


@contextmanager
def sides() -> Iterator[dict[str, Side]]:
    with ExitStack() as es:
        out = {}
        for mode in ("fifo", "admit"):
            s = es.enter_context(stack(owner=f"bench-{mode}"))
            write_shard(s.tmp / "data" / "tiny" / "train_000.bin",
                        np.random.default_rng(0).integers(0, 256, 400_000))  # fmt: skip
            api = s.serve_api(1, TRAINQ_SCHEDULER=mode, TRAINQ_RECONCILE="true")
            side = Side(mode, s, api.url, httpx.Client(base_url=api.url, headers=s.auth,
                        timeout=30), sa.create_engine(s.pg_url))  # fmt: skip
            es.callback(side.stop)
            side.add_workers(1)
            out[mode] = side
        yield out


def part_exec(sd: dict[str, Side], samples: int) -> list[str]:
    print(f"\n2. submit -> torchrun exec on an idle worker, {samples} samples each, alternated")
    for side in sd.values():
        side.exec_sample()  # warm: the worker's first imports, the API's first send
    got: dict[str, list[float]] = {m: [] for m in sd}
    for i in range(samples):
        for m in list(sd) if i % 2 == 0 else list(reversed(sd)):
            got[m].append(sd[m].exec_sample())
            time.sleep(0.3)  # an idle worker: its registry entry is up to date
    lines = []
    for m, xs in got.items():
        p = percentiles(xs)
        print(f"  {m:5s} p50 {p['p50']:6.1f} ms  p90 {p['p90']:6.1f} ms  max {p['max']:6.1f} ms")
    pa, pf = percentiles(got["admit"]), percentiles(got["fifo"])
    lines.append(
        f"submit -> torchrun exec: admit p50 {pa['p50']:.0f} ms p90 {pa['p90']:.0f} ms, fifo "
        f"p50 {pf['p50']:.0f} ms p90 {pf['p90']:.0f} ms (10 ms clock; goal admit p50 <= 50 ms): "
        f"{goal(pa['p50'] <= 50)}"
    )
    return lines


def part_drain(sd: dict[str, Side], n: int, rounds: int) -> list[str]:
    for side in sd.values():
        side.add_workers(4)
    print(f"\n3. drain: {n} one-step jobs, 4 one-slot workers, {rounds} round(s), alternated")
    walls: dict[str, list[float]] = {m: [] for m in sd}
    for i in range(rounds):
        for m in list(sd) if i % 2 == 0 else list(reversed(sd)):
            wall, by = sd[m].drain(n, f"drain-{i}")
            walls[m].append(wall)
            print(f"  {m:5s} round {i}: {wall:6.1f} s, {n / wall:.2f} jobs/s, {by}")
    wa, wf = statistics.median(walls["admit"]), statistics.median(walls["fifo"])
    return [
        f"drain {n} one-step jobs on 4 workers: admit {wa:.1f} s ({n / wa:.2f} jobs/s), fifo "
        f"{wf:.1f} s ({n / wf:.2f} jobs/s), admit/fifo {wa / wf:.3f} (goal <= 1.05): "
        f"{goal(wa / wf <= 1.05)}"
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decide", action="store_true", help="part 1 only (with the others given)")
    p.add_argument("--exec", action="store_true", help="part 2")
    p.add_argument("--drain", action="store_true", help="part 3")
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--passes", type=int, default=20)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--drain-jobs", type=int, default=200)
    p.add_argument("--drain-rounds", type=int, default=1)
    a = p.parse_args()
    every = not (a.decide or a.exec or a.drain)
    print(SHARED_CORES_NOTE)
    summary: list[str] = []
    if every or a.decide:
        summary += part_decide(a)
    if every or a.exec or a.drain:
        with sides() as sd:
            if every or a.exec:
                summary += part_exec(sd, a.samples)
            if every or a.drain:
                summary += part_drain(sd, a.drain_jobs, a.drain_rounds)
    print("\nsummary:")
    for line in summary:
        print(f"  {line}")


if __name__ == "__main__":
    main()
