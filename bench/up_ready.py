"""How long `trainq up` takes to be ready: the API answering and its worker registered.

Each run starts `trainq up` in a fresh data folder (first start: migrations on an empty
SQLite) and then again in the same folder (a restart: already migrated), polls from
outside until GET /healthz answers and GET /v1/workers lists the worker, then sends SIGINT
and times the stop. Side by side, in the same run, the floor: a bare `python -c "import
service.api.app"` (what the API process must load before it can answer anything).

    python bench/up_ready.py [--runs 5]

Goal: ready <= 5 s on this class of machine (2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

# `trainq` as the console script runs it: the Typer app of service/cli/main.py.
TRAINQ = ["-m", "service.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [e.get("PYTHONPATH")])])
    return e


def one_run(data_dir: Path) -> tuple[float, float, float]:
    """(API answering, worker registered, stopped after SIGINT), seconds."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *TRAINQ, "up", "--port", str(port), "--data-dir", str(data_dir)],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    t_api = t_worker = None
    try:
        while t_worker is None:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"trainq up exited: {err[-2000:]}")
            if time.monotonic() - t0 > 120:
                raise RuntimeError("not ready after 120 s")
            try:
                if t_api is None and httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    t_api = time.monotonic() - t0
                if t_api is not None and httpx.get(f"{url}/v1/workers", timeout=1).json()["items"]:
                    t_worker = time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        t_stop0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        t_stop = time.monotonic() - t_stop0
    assert t_api is not None
    return t_api, t_worker, t_stop


def import_floor() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import service.api.app"], env=env(), check=True)
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    fresh: list[float] = []
    again: list[float] = []
    stops: list[float] = []
    floors: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            data = Path(tmp) / f"run{i}"
            for label, bucket in (("fresh", fresh), ("restart", again)):
                api, ready, stop = one_run(data)
                bucket.append(ready)
                stops.append(stop)
                print(
                    f"run {i} {label:7s}: API answering {api:5.2f} s, worker registered "
                    f"{ready:5.2f} s, stopped {stop:5.2f} s after SIGINT",
                    flush=True,
                )
            floors.append(import_floor())
    mf, ma = statistics.median(fresh), statistics.median(again)
    floor = statistics.median(floors)
    print(f"median ready: fresh data folder {mf:.2f} s, restart {ma:.2f} s (goal <= 5 s)")
    print(f"median stop after SIGINT: {statistics.median(stops):.2f} s")
    print(f"floor: `import service.api.app` alone {floor:.2f} s; ready/floor = {mf / floor:.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
