"""Conversations in over HTTP, a model fine-tuned on their answers: ``trainq data upload
--format chat --wait`` against the real system (uvicorn API with auth, PostgreSQL, Redis, a
Celery worker, torchrun on CPU) prints the dataset's report; a bad line is refused by number
before a byte is sent; a job naming the dataset runs to success."""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import System, create_token, wait_for
from tests.e2e.test_datasets_e2e import trainq

pytestmark = pytest.mark.timeout(150)


def _chat(user: str, answer: str) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages})


def test_a_chat_dataset_uploads_with_its_report_and_trains(
    fast_system: System, tmp_path: Path
) -> None:
    api = fast_system.start_api(auth=True)
    owner = f"sft-{uuid.uuid4().hex[:6]}"
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], owner)
    queue = f"sft-{uuid.uuid4().hex[:6]}"
    pool = ThreadPoolExecutor(1)
    worker = pool.submit(fast_system.start_worker, queue, name=f"sft-{os.getpid()}")
    env = {**fast_system.env, "TRAINQ_URL": api.url, "TRAINQ_TOKEN": api.token}

    chats = tmp_path / "chats.jsonl"
    lines = [_chat(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(80)]
    chats.write_text("\n".join(lines) + "\n", encoding="utf-8")
    up = trainq(
        env, "data", "upload", str(chats), "--name", "chats", "--format", "chat",
        "--max-len", "100", "--wait",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "dataset chats ready" in up.stdout
    assert "80 examples" in up.stdout and "carry loss" in up.stdout and "dropped: none" in up.stdout
    assert "\nlongest example " in up.stdout and "% of the rows are tokens" in up.stdout
    assert "\\x0a" not in up.stdout  # each line printed as a line, not escaped
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_chat("fine", "ok") + "\n" + json.dumps({"messages": [{"role": "x"}]}) + "\n")
    refused = trainq(env, "data", "upload", str(bad), "--name", "bad", "--format", "chat")
    assert refused.returncode == 6, refused.stderr
    assert "line 2: messages[0] has role" in refused.stderr

    worker.result(timeout=90)
    pool.shutdown()
    train: dict[str, Any] = {
        "steps": 6,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
        "data": {"dataset": "chats"},
        "batch": {"micro_batch_size": 2, "grad_accum_steps": 2},
        "eval": {"every": 3, "steps": 1},
        "checkpoint": {"every": 0},
    }
    with api.client() as client:
        resp = client.post("/v1/jobs", json={"name": "on-chats", "queue": queue, "train": train})
        assert resp.status_code == 201, resp.text
        job = resp.json()

        def ended() -> dict[str, Any] | None:
            found: dict[str, Any] = client.get(f"/v1/jobs/{job['id']}").json()
            return found if found["status"] in ("succeeded", "failed", "cancelled") else None

        done = wait_for(ended, 120, "the job on the chat dataset to end", every=0.5)
        assert done["status"] == "succeeded", done
        assert done["latest"]["step"] == 6
