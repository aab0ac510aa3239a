"""Experiment trackers end to end (train.tracking, trainer.tracking): a real job of the
module's system (conftest ``fast_system``) logs to a real ``mlflow server`` this module
starts (SQLite backend, loopback) and to a W&B offline run in its run folder.

Read back with the trackers' own readers: MLflow's ``MlflowClient`` must hold every point
the job's metrics API returns, at its step, with the same value; the W&B run's history
(its ``.wandb`` log, what ``wandb sync`` uploads, read with ``wandb leet inspect``) holds
the job's losses. A tracker that is down (a URI to a closed port) costs the job nothing but
one warning line in its log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import Api, System, free_port, wait_for

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("wandb") is None,
        reason="the trackers' packages (mlflow, wandb: the dev extra) are not installed",
    ),
]

QUEUE = "e2e-track"
STEPS = 12
TRAIN: dict[str, Any] = {
    "steps": STEPS,
    "seed": 3,
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 6, "steps": 1},  # val_loss at steps 6 and 12
    "checkpoint": {"every": 0, "keep": 1, "hf": "none"},
}
WARNING = "trainer: tracking: warning:"


class MlflowServer:
    """``mlflow server`` on a free loopback port (SQLite store), started at once and
    waited for later, so that it comes up while the trainq system does."""

    def __init__(self, root: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "mlflow.log"
        argv = [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
            *("--default-artifact-root", str(root / "artifacts")),
            *("--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--workers", "1"),
        ]
        # Its job runner (huey consumers, for GenAI evaluation jobs) is nothing tracking needs.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float = 90) -> str:
        def up() -> bool:
            if self.proc.poll() is not None:
                return True
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, timeout, "mlflow server", every=0.3)
        except TimeoutError:
            pass
        if self.proc.poll() is not None or not up():
            tail = self.log.read_text(errors="replace")[-2000:]
            pytest.skip(f"mlflow server did not start:\n{tail}")
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(fast_system: System, mlflow_server: MlflowServer) -> Api:
    # The tracking server is on loopback: the admin setting lets both the API (submit's
    # check) and the worker (the trainer's check) reach it.
    fast_system.env["TRAINQ_TRACKING_ALLOW_PRIVATE"] = "1"
    api = fast_system.start_api(auth=False)
    fast_system.start_worker(QUEUE, name=f"track-{os.getpid()}")
    return api


def _submit(api: Api, name: str, train: dict[str, Any]) -> str:
    with api.client() as client:
        r = client.post("/v1/jobs", json={"name": name, "queue": QUEUE, "train": train})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _finished(api: Api, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        with api.client() as client:
            job = dict(client.get(f"/v1/jobs/{job_id}").json())
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    return dict(wait_for(done, 120, f"job {job_id} to finish", every=0.2))


def _get(api: Api, path: str, **params: Any) -> httpx.Response:
    with api.client() as client:
        r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r


def _wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the run's offline .wandb log, read by wandb's own CLI
    (``wandb leet inspect --json``: one JSON record a line)."""
    [folder] = run_dir.glob("wandb/offline-run-*")
    assert list(folder.glob("run-*.wandb")), "the offline run's transaction log, for wandb sync"
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(folder)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# First: it runs while the mlflow server is still starting.
def test_a_tracker_that_is_down_costs_the_job_one_warning_line(api: Api) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # free a moment ago: nothing listens there
    tracking = {"mlflow": {"tracking_uri": closed}}
    job_id = _submit(api, "tracker-down", {**TRAIN, "tracking": tracking})
    job = _finished(api, job_id)
    logs = _get(api, f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "succeeded", (job, logs)
    warnings = [line for line in logs.splitlines() if WARNING in line]
    assert len(warnings) == 1 and "mlflow" in warnings[0], logs
    points = _get(api, f"/v1/jobs/{job_id}/metrics").json()["points"]
    assert len(points) == STEPS


def test_a_job_logs_to_mlflow_and_wandb_the_numbers_of_its_metrics_api(
    api: Api, fast_system: System, mlflow_server: MlflowServer
) -> None:
    url = mlflow_server.wait()
    tracking = {
        "mlflow": {"tracking_uri": url, "experiment": "trainq-e2e"},
        "wandb": {"project": "trainq-e2e", "mode": "offline", "tags": ["e2e"]},
    }
    job_id = _submit(api, "tracked", {**TRAIN, "tracking": tracking})
    job = _finished(api, job_id)
    logs = _get(api, f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "succeeded", (job, logs)
    assert WARNING not in logs, logs
    points = _get(api, f"/v1/jobs/{job_id}/metrics", max_points=100_000).json()["points"]
    assert [p["step"] for p in points] == list(range(1, STEPS + 1))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name("trainq-e2e")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.tags["trainq.job_id"] == job_id
    assert run.data.tags["trainq.checkpoint_step"] == str(STEPS)
    assert run.data.tags["trainq.checkpoint"].endswith(f"{job_id}/checkpoints/step-{STEPS}")
    assert run.data.params["optim.lr"] == "0.01" and run.data.params["steps"] == str(STEPS)
    assert run.data.params["tracking.mlflow.experiment"] == "trainq-e2e"
    from service.api.streams.schemas import METRIC_FIELDS

    fields = [f for f in METRIC_FIELDS if f not in ("steps", "time")]  # step: x, time: stamp
    assert set(run.data.metrics) == {f for f in fields if any(p[f] is not None for p in points)}
    compared = 0
    for field in fields:
        want = {p["step"]: p[field] for p in points if p[field] is not None}
        history = client.get_metric_history(run.info.run_id, field)
        assert {m.step: m.value for m in history} == want, field
        stamps = {p["step"]: int(p["time"] * 1000) for p in points if p[field] is not None}
        assert {m.step: m.timestamp for m in history} == stamps, field
        compared += len(want)
    assert compared >= 8 * STEPS + 2  # the CPU has no mfu; val_loss at two steps
    assert client.get_run(run.info.run_id).info.status == "FINISHED"

    run_dir = Path(fast_system.env["TRAINQ_RUNS_ROOT"]) / job_id
    records = _wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    summary: dict[str, Any] = {}
    for r in records:
        if r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["trainq.checkpoint"] == run.data.tags["trainq.checkpoint"]
    assert {int(r["_step"]): r["loss"] for r in history} == {p["step"]: p["loss"] for p in points}
    assert {int(r["_step"]): r["val_loss"] for r in history if "val_loss" in r} == {
        p["step"]: p["val_loss"] for p in points if p["val_loss"] is not None
    }
