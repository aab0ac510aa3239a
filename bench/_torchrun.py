"""Trainer benchmarks' launching: torchrun jobs on this machine, timed by the stamps their own
steps write, with their ranks' CPU from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench._util import REPO, base_env

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


def run_bare_loop(
    script: Path, params: dict[str, Any], work: Path, name: str, nproc: int, timeout: float
) -> tuple[dict[str, Any], Launch]:
    """A bare-loop script (bench/models.py's, bench/moe.py's) on ``nproc`` ranks: ``params``
    written to ``work/NAME.params.json`` (its ``out`` added: where rank 0 writes its result),
    torchrun ``script`` with that file, then (the result it wrote, the launch)."""
    out = work / f"{name}.out.json"
    pfile = work / f"{name}.params.json"
    pfile.write_text(json.dumps({**params, "out": str(out)}))
    run = launch([*torchrun(nproc), str(script), str(pfile)], work / f"{name}.log", timeout,
                 launcher=True)  # fmt: skip
    return json.loads(out.read_text()), run


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
