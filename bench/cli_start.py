"""How fast the client commands start: `trainq submit --help` and `trainq status` against
nothing, side by side with a bare interpreter and with importing typer alone.

    python bench/cli_start.py [--runs 10]

The client commands import neither torch nor Celery nor SQLAlchemy; this shows what they
cost over the floor that any Typer CLI pays.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINQ_URL": dead}
    py = sys.executable
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "python -c 'import typer'": [py, "-c", "import typer"],
        "trainq submit --help": [py, "-m", "service.cli", "submit", "--help"],
        "trainq status X (unreachable)": [py, "-m", "service.cli", "status", "abc"],
        "python -c 'import torch' (for scale)": [py, "-c", "import torch"],
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):  # interleaved, so a change of load hits every case alike
        for name, argv in cases.items():
            samples[name].append(timed(argv, env))
    floor = statistics.median(samples["python -c 'import typer'"])
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"{name:40s} median {med * 1000:7.0f} ms   {med / floor:5.2f}x import typer")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
