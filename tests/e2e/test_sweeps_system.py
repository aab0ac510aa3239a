"""Sweeps on a whole system (service.api.sweeps): the API process proposes and prunes, two
real `trainq worker` processes run the trials with torchrun on CPU.

- A grid sweep of 4 trials, submitted with ``trainq sweep submit --wait``, gives per step the
  losses of the same 4 jobs submitted by hand; ``trainq sweep status`` lists them best first.
- ASHA over 8 learning rates from 1e-5 to 1e-1 (one trial at a time, in the listed order,
  which is neither best first nor worst first) stops at least the worst half of them (they
  end ``stopped_early``, with no retry spent); the best trial is the one the full grid picks
  (the grid run here by the trainer in this process, to its last step).
- A seeded random sweep whose API process is killed mid-sweep and started again proposes
  exactly its budget, none twice, and the very points its seed gives.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST_SETTINGS
from tests.e2e.system import Api, System, build_system, create_token, wait_for
from tests.e2e.test_system import TRAIN

pytestmark = pytest.mark.timeout(300)

QUEUE = "sweeps"
CHEAP = {**TRAIN, "steps": 6, "checkpoint": {"every": 0, "keep": 1, "hf": "none"}}
# ASHA's trials: rungs at 3, 6 and 12 steps of 24.
ASHA_TRAIN = {**CHEAP, "steps": 24, "checkpoint": {"every": 0, "keep": 1, "hf": "none"}}
# 1e-5 .. 1e-1, log-spaced, in an order that is neither best first nor worst first.
LRS = [7.2e-3, 1e-5, 1e-1, 1.4e-4, 1.9e-3, 3.7e-5, 2.7e-2, 5.2e-4]


class Cluster:
    grid_sweep: str | None = None

    def __init__(self, system: System) -> None:
        self.system = system
        self.api: Api = system.start_api(auth=True)
        self.token = create_token(system.env["TRAINQ_DATABASE_URL"], f"sw-{uuid.uuid4().hex[:6]}")
        self.api.token = self.token
        tag = uuid.uuid4().hex[:6]
        for n in range(2):
            system.start_worker(QUEUE, name=f"sweeps-{n}-{tag}")

    def client(self) -> httpx.Client:
        return self.api.client()

    def sweep(self, sweep_id: str) -> dict[str, Any]:
        with self.client() as c:
            r = c.get(f"/v1/sweeps/{sweep_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_sweep(self, sweep_id: str, timeout: float) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            sweep = self.sweep(sweep_id)
            return sweep if sweep["status"] != "running" else None

        try:
            return dict(wait_for(ended, timeout, f"sweep {sweep_id} to end", every=0.5))
        except TimeoutError as exc:
            tails = "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.system.procs)
            raise AssertionError(f"{exc}: {self.sweep(sweep_id)}\n{tails}") from None

    def losses(self, job_id: str) -> dict[int, float]:
        with self.client() as c:
            r = c.get(f"/v1/jobs/{job_id}/metrics")
        assert r.status_code == 200, r.text
        return {p["step"]: p["loss"] for p in r.json()["points"]}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**self.system.env, "TRAINQ_URL": self.api.url, "TRAINQ_TOKEN": self.token}
        return subprocess.run(
            [sys.executable, "-m", "service.cli", *args],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    settings = {**FAST_SETTINGS, "TRAINQ_SWEEP_INTERVAL_S": "0.3", "TRAINQ_ADMIT_INTERVAL_S": "0.5"}
    system = build_system(
        tmp_path_factory.mktemp("sweeps"), pg_url, redis_dbs, subprocess_env, settings
    )
    yield Cluster(system)
    system.stop()


def test_a_grid_sweep_gives_the_losses_of_its_jobs_submitted_by_hand(
    cluster: Cluster, tmp_path: Path
) -> None:
    lrs = [3e-3, 1e-2]
    sizes = [2, 4]
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        json.dumps(
            {
                "name": "grid",
                "base": {"queue": QUEUE, "train": CHEAP},
                "space": {
                    "train.optim.lr": {"type": "choice", "values": lrs},
                    "train.batch.micro_batch_size": {"type": "choice", "values": sizes},
                },
                "method": "grid",
                "metric": "loss",
                "parallelism": 4,
                "budget": 10,
            }
        )
    )
    by_hand = {}
    with cluster.client() as c:
        for lr in lrs:
            for size in sizes:
                train = {
                    **CHEAP,
                    "optim": {"lr": lr, "warmup_steps": 2},
                    "batch": {"micro_batch_size": size},
                }
                r = c.post("/v1/jobs", json={"name": "hand", "queue": QUEUE, "train": train})
                assert r.status_code == 201, r.text
                by_hand[(lr, size)] = r.json()["id"]
    done = cluster.cli("sweep", "submit", str(sweep_file), "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    sweep_id = done.stdout.split()[1]
    sweep = cluster.sweep(sweep_id)
    assert sweep["status"] == "finished" and len(sweep["trials"]) == 4
    for t in sweep["trials"]:
        assert t["status"] == "succeeded", t
        key = (t["params"]["train.optim.lr"], t["params"]["train.batch.micro_batch_size"])
        hand = by_hand[key]
        with cluster.client() as c:
            wait_for(
                lambda h=hand: c.get(f"/v1/jobs/{h}").json()["status"] == "succeeded",
                120,
                "hand jobs",
            )
        assert cluster.losses(t["job_id"]) == cluster.losses(hand)
        assert len(cluster.losses(hand)) == CHEAP["steps"]
    status = cluster.cli("sweep", "status", sweep_id)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines()[1:] if line.split()[0].isdigit()]
    values = [float(row[-3]) for row in rows]
    assert values == sorted(values) and len(rows) == 4  # best first
    cluster.grid_sweep = sweep_id
    best = sweep["best_trial"]
    assert round(best["value"], 4) == min(values)
    assert f"best trial {best['number']}" in status.stdout


def test_the_dashboard_draws_a_sweeps_trials_on_one_chart(
    cluster: Cluster, dash_browser: Any
) -> None:
    if cluster.grid_sweep is None:
        pytest.skip("the grid sweep did not run")
    context = dash_browser.new_context(base_url=cluster.api.url)
    context.add_init_script(f"localStorage.setItem('trainq.token', {json.dumps(cluster.token)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"/#/sweeps/{cluster.grid_sweep}")
        page.wait_for_function("() => window.__trainq.sweep && window.__trainq.sweep.series === 4")
        assert page.locator("[data-chart=sweep-loss] canvas").count() == 1
        assert page.locator("table.sweep-trials tbody tr").count() == 4
        labels = page.locator("[data-chart=sweep-loss] .u-legend .u-series").all_inner_texts()
        assert sum("trial" in label for label in labels) == 4
    finally:
        context.close()
    assert errors == []


def _full_grid(tmp_path: Path, data: Path) -> dict[float, float]:
    """The last-step loss of each learning rate, run to its end by the trainer in process."""
    from trainer.config import TrainConfig
    from trainer.env import TrainerEnv
    from trainer.train import train

    final = {}
    for lr in LRS:
        cfg = TrainConfig.model_validate({**ASHA_TRAIN, "optim": {"lr": lr, "warmup_steps": 2}})
        run = tmp_path / f"lr{lr}"
        run.mkdir()
        assert train(cfg, run, data, TrainerEnv()) == 0
        points = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        final[lr] = next(p["loss"] for p in points if p.get("step") == ASHA_TRAIN["steps"])
    return final


def test_asha_stops_the_worst_half_and_keeps_the_best(cluster: Cluster, tmp_path: Path) -> None:
    body = {
        "name": "asha",
        "base": {"queue": QUEUE, "retries": 1, "train": ASHA_TRAIN},
        "space": {"train.optim.lr": {"type": "choice", "values": LRS}},
        "method": "grid",
        "metric": "loss",
        # One at a time: ASHA promotes the first trial to reach a rung, so with trials side
        # by side which one got there first (a race) would decide; in order it is exact.
        "parallelism": 1,
        "budget": 8,
        "early_stop": {"method": "asha", "min_steps": 3, "reduction_factor": 2},
    }
    with cluster.client() as c:
        r = c.post("/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    torch_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        grid = _full_grid(tmp_path, Path(cluster.system.env["TRAINQ_DATA_ROOT"]) / "demo")
        torch.set_num_threads(threads)
    finally:
        if torch_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    sweep = cluster.wait_sweep(r.json()["id"], 240)
    trials = {t["params"]["train.optim.lr"]: t for t in sweep["trials"]}
    assert sorted(trials) == sorted(LRS)
    stopped = {lr for lr, t in trials.items() if t["status"] == "stopped_early"}
    worst_half = sorted(LRS, key=lambda lr: grid[lr])[4:]
    assert set(worst_half) <= stopped, (stopped, grid)
    for lr in stopped:  # stopped as a cancel is: no retry, the checkpoint kept
        # (A trial this cheap may reach its last step before the stop lands; it still ends
        # stopped_early, as a cancelled job that happened to finish ends cancelled.)
        job_id = trials[lr]["job_id"]
        with cluster.client() as c:
            job = c.get(f"/v1/jobs/{job_id}").json()
            kept = c.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
        assert job["retries_used"] == 0 and len(job["attempts"]) == 1, job
        assert job["reason"] == "stopped_early" and len(kept) >= 1, (job, kept)
    best = min(grid, key=lambda lr: grid[lr])
    assert sweep["best_trial"]["params"]["train.optim.lr"] == best, (sweep["best_trial"], grid)
    assert math.isclose(sweep["best_trial"]["value"], grid[best], rel_tol=1e-5)


def test_a_seeded_sweep_whose_api_is_killed_midway_proposes_its_points_once(
    cluster: Cluster,
) -> None:
    from service.api.sweeps import search, space

    lr = {"type": "loguniform", "low": 1e-4, "high": 1e-2}
    body = {
        "name": "restart",
        "base": {"queue": QUEUE, "train": {**CHEAP, "steps": 3}},
        "space": {"train.optim.lr": lr},
        "method": "random",
        "metric": "loss",
        "seed": 11,
        "parallelism": 2,
        "budget": 4,
    }
    with cluster.client() as c:
        r = c.post("/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    wait_for(lambda: cluster.sweep(sweep_id)["proposed"] >= 2, 30, "the first trials")
    proc = cluster.api.proc  # killed, not stopped: no cleanup of any kind
    os.killpg(os.getpgid(proc.popen.pid), signal.SIGKILL)
    proc.popen.wait(10)
    cluster.api = cluster.system.start_api(auth=True)
    cluster.api.token = cluster.token
    sweep = cluster.wait_sweep(sweep_id, 180)
    got = [t["params"]["train.optim.lr"] for t in sweep["trials"]]
    study = search.new_study("random", "min", 11, None)
    dists = space.distributions({"train.optim.lr": lr})
    expected = [study.ask(dists).params["train.optim.lr"] for _ in range(4)]
    assert sweep["status"] == "finished" and sweep["proposed"] == 4
    assert got == expected  # the seed's points, in order, each once
    assert all(t["status"] == "succeeded" for t in sweep["trials"]), sweep["trials"]
