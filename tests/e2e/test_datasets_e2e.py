"""A corpus in over HTTP, a model trained on it: ``trainq data upload --wait`` against the
real system (uvicorn API with auth, PostgreSQL, Redis, a Celery worker, torchrun on CPU),
then a job naming the dataset runs to success on the folder the service froze into it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import System, create_token, wait_for

pytestmark = pytest.mark.timeout(150)

CORPUS = "The quick brown fox jumps over the lazy dog. Ünïcödé too.\n" * 300


def trainq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_upload_over_http_then_train_on_it_to_success(fast_system: System, tmp_path: Path) -> None:
    api = fast_system.start_api(auth=True)
    owner = f"data-{uuid.uuid4().hex[:6]}"
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], owner)
    queue = f"ds-{uuid.uuid4().hex[:6]}"
    # The worker starts (and registers) while the corpus uploads.
    pool = ThreadPoolExecutor(1)
    worker = pool.submit(fast_system.start_worker, queue, name=f"ds-{os.getpid()}")
    env = {**fast_system.env, "TRAINQ_URL": api.url, "TRAINQ_TOKEN": api.token}

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    up = trainq(env, "data", "upload", str(corpus), "--name", "fox", "--wait")
    assert up.returncode == 0, up.stderr
    assert "dataset fox ready" in up.stdout and "train.data.dataset=fox" in up.stdout
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine so far \xc3(")
    refused = trainq(env, "data", "upload", str(bad), "--name", "bad")
    assert refused.returncode == 6, refused.stderr
    assert refused.stderr.count("\n") == 1 and "byte offset 12" in refused.stderr

    worker.result(timeout=90)
    pool.shutdown()
    train: dict[str, Any] = {
        "steps": 8,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
        "data": {"dataset": "fox"},
        "batch": {"micro_batch_size": 4},
        "eval": {"every": 4, "steps": 1},
        "checkpoint": {"every": 0},
    }
    with api.client() as client:
        resp = client.post("/v1/jobs", json={"name": "on-fox", "queue": queue, "train": train})
        assert resp.status_code == 201, resp.text
        job = resp.json()
        path = client.get("/v1/datasets/fox").json()["path"]
        assert job["train"]["data"]["path"] == path

        def ended() -> dict[str, Any] | None:
            found: dict[str, Any] = client.get(f"/v1/jobs/{job['id']}").json()
            return found if found["status"] in ("succeeded", "failed", "cancelled") else None

        done = wait_for(ended, 120, "the job on the uploaded dataset to end", every=0.5)
        assert done["status"] == "succeeded", done
        assert done["latest"]["step"] == 8
        # No longer used by a queued or running job: it may go.
        assert client.delete("/v1/datasets/fox").status_code == 204
        assert client.get("/v1/datasets").json() == {"items": []}
        # The dashboard's datasets page is served, and linked from the page.
        assert client.get("/ui/js/datasets.js").status_code == 200
        assert 'href="#/datasets"' in client.get("/").text
    runs = Path(fast_system.env["TRAINQ_RUNS_ROOT"])
    config = json.loads((runs / job["id"] / "config.json").read_text())
    assert config["data"]["path"] == path  # what the trainer read (and others will look for)
