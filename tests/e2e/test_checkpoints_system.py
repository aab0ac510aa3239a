"""A finished job is a model: train through the real system, list its checkpoints, download
the Hugging Face folder over HTTP and load it with transformers.

The system (tests/e2e/system.py): the API under uvicorn with auth on, PostgreSQL, Redis,
one Celery worker launching torchrun with 2 ranks (DDP, gloo on CPU). The trainer writes
step-N/hf at the end of the run (trainer.publish); the API only streams files.
"""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.cli import main as trainq
from tests.e2e.system import System, create_token, wait_for

pytestmark = pytest.mark.timeout(180)

STEPS = 6
TRAIN: dict[str, Any] = {
    "steps": STEPS,
    "seed": 3,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 3, "steps": 1},
    "checkpoint": {"every": 3, "keep": 2},  # hf: final, the default
}
# The largest |logit| difference allowed between transformers' model loaded from the
# downloaded folder and the trainer's own model from the native checkpoint, in fp32: the
# export's own check (trainer.export.ATOL); on this model they agree to the last bit.
ATOL = 1e-4


def test_train_list_download_hf_and_load_with_transformers(
    fast_system: System, tmp_path: Path
) -> None:
    api = fast_system.start_api(auth=True)
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], "ckpt-user")
    queue = f"ckpt-{uuid.uuid4().hex[:6]}"
    fast_system.start_worker(queue, name=f"ckpt-{uuid.uuid4().hex[:6]}")
    with api.client() as client:
        r = client.post(
            "/v1/jobs",
            json={"name": "ckpt", "queue": queue, "procs_per_node": 2, "train": TRAIN},
        )
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]

        def ended() -> dict[str, Any] | None:
            job = client.get(f"/v1/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_for(ended, 150, f"job {job_id} to end", every=0.5)
        assert job["status"] == "succeeded", job

        listed = client.get(f"/v1/jobs/{job_id}/checkpoints")
        assert listed.status_code == 200, listed.text
        items = listed.json()["items"]
        assert [c["step"] for c in items] == [3, 6]
        last = items[-1]
        assert last["latest"] and last["formats"] == ["native", "hf"]
        assert last["strategy"] == "ddp" and last["world_size"] == 2
        assert last["tokens_seen"] == STEPS * 2 * 4 * 32
        assert last["loss"] is not None and last["val_loss"] is not None
        assert items[0]["formats"] == ["native"]  # hf: final writes the last one only

        out = tmp_path / "hf"
        with client.stream(
            "GET", f"/v1/jobs/{job_id}/checkpoints/latest/download", params={"format": "hf"}
        ) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["x-trainq-step"] == str(STEPS)
            body = b"".join(resp.iter_bytes())
        assert len(body) == int(resp.headers["content-length"])
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
            tar.extractall(out, filter="data")

    # The native checkpoint through the CLI (in this process: its start is not the point).
    native = tmp_path / "native"
    env = {"TRAINQ_URL": api.url, "TRAINQ_TOKEN": api.token}
    cli = CliRunner().invoke(trainq.app, ["download", job_id, "-o", str(native)], env=env)
    assert cli.exit_code == 0, cli.output
    assert f"downloaded step {STEPS} of job {job_id}" in cli.stdout
    assert (native / "DONE").is_file() and (native / "model.pt").is_file()

    import torch
    import transformers

    from trainer.export import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ours, step = load_model(tmp_path, native)  # the trainer's model, from the native files
    assert step == STEPS
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(input_ids=tokens, use_cache=False).logits
    assert got.shape == expected.shape == (2, 32, 256)
    assert float((got - expected).abs().max()) <= ATOL
