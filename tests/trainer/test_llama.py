"""The llama family under real torchrun (CPU, gloo): one process == DDP == FSDP2, with and
without activation checkpointing, FSDP2's reshard choice and CPU offload; a golden loss file
of its own; exact resume after a SIGKILL, as the GPT's (test_resume.py)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import runs
from trainer.config import TrainConfig
from trainer.models import build_model

LLAMA: dict[str, Any] = {
    "family": "llama",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,  # grouped-query attention: two query heads per key/value head
    "d_model": 32,
    "seq_len": 32,
    "vocab_size": 256,
}
STEPS = 12


def llama_config(**overrides: Any) -> dict[str, Any]:
    cfg = runs.config(model=dict(LLAMA), steps=STEPS, eval={"every": 6, "steps": 2})
    cfg["checkpoint"] = {"every": 6, "keep": 2}
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    return cfg


def golden_llama_config() -> dict[str, Any]:
    return llama_config(batch={"micro_batch_size": 8})


def _run(
    tmp: Path, name: str, cfg: dict[str, Any], data_root: Path, env: Any, n: int
) -> list[float]:
    return runs.run_losses(cfg, tmp / name, data_root, env, n)


@pytest.fixture(scope="module")
def llama_runs(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("llama")
    fsdp = {"strategy": "fsdp", "batch": {"micro_batch_size": 2, "grad_accum_steps": 2}}
    return {
        "single": _run(tmp, "single", golden_llama_config(), data_root, subprocess_env, 1),
        "ddp": _run(tmp, "ddp", llama_config(), data_root, subprocess_env, 2),
        # FSDP2 with full activation checkpointing, blocks kept gathered until backward.
        "fsdp_ac": _run(
            tmp,
            "fsdp_ac",
            llama_config(
                **fsdp, activation_checkpointing="full", fsdp={"reshard_after_forward": False}
            ),
            data_root,
            subprocess_env,
            2,
        ),
        # FSDP2 with selective (every second block) activation checkpointing; cpu_offload is
        # accepted and, on a CPU run, changes nothing (its GPU path: tests/trainer/test_gpu.py).
        "fsdp_selective": _run(
            tmp,
            "fsdp_selective",
            llama_config(**fsdp, activation_checkpointing="selective", fsdp={"cpu_offload": True}),
            data_root,
            subprocess_env,
            2,
        ),
    }


def test_llama_trains_and_the_loss_falls(llama_runs: dict[str, list[float]]) -> None:
    losses = llama_runs["single"]
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert max(losses[-3:]) < losses[0] - 1.0, losses


@pytest.mark.parametrize("other", ["ddp", "fsdp_ac", "fsdp_selective"])
def test_llama_one_process_ddp_fsdp_and_memory_options_agree(
    llama_runs: dict[str, list[float]], other: str
) -> None:
    # The same 8 samples a step every way; activation checkpointing recomputes exactly what
    # it dropped and offload only moves tensors, so the losses differ by float reassociation
    # of the reductions alone.
    single, got = llama_runs["single"], llama_runs[other]
    assert got[:5] == pytest.approx(single[:5], rel=1e-5, abs=0)
    assert got == pytest.approx(single, rel=1e-4, abs=0)


def test_llama_golden_losses(llama_runs: dict[str, list[float]]) -> None:
    golden = json.loads(runs.LLAMA_GOLDEN.read_text())
    assert golden["config"] == golden_llama_config(), (
        "the golden config changed; regenerate with `python -m tests.trainer.regen_golden`"
    )
    assert llama_runs["single"] == pytest.approx(golden["losses"], abs=1e-4, rel=0), (
        "llama losses drifted from tests/trainer/golden/llama_debug_losses.json"
    )


def test_grouped_query_attention_and_tied_embeddings_shape_the_model() -> None:
    cfg = TrainConfig.model_validate({"model": {**LLAMA, "tie_embeddings": True}}).model
    model: Any = build_model(cfg)
    attn = model.blocks[0].attention
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (16, 32)  # 2 kv heads
    assert model.output.weight is model.tok_embeddings.weight
    untied: Any = build_model(TrainConfig.model_validate({"model": LLAMA}).model)
    assert model.num_params() == untied.num_params() - 256 * 32
    torch.manual_seed(0)
    model.init_weights()
    x = torch.randint(0, 256, (2, 16))
    assert model(x).shape == (2, 16, 256)


def test_llama_killed_after_checkpoint_resumes_exactly(
    llama_runs: dict[str, list[float]],
    data_root: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    # As test_resume.py does for the GPT under DDP, here in one process (the GPT's test
    # covers the ranks; this one the llama's own state: its weights, rotary tables, AdamW).
    # A long eval at step 7 holds the run just after the step-6 checkpoint (eval touches no
    # training state, so the losses stay the reference's).
    run_dir = tmp_path / "run"
    held = golden_llama_config()
    held["eval"] = {"every": 7, "steps": 200}
    proc = runs.start(held, run_dir, data_root, subprocess_env, nproc=1)
    done = run_dir / "checkpoints" / "step-6" / "DONE"
    runs.wait_for(done.exists, 90, "the step-6 checkpoint", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # a crash: no handler runs, nothing more is saved
    proc.communicate()
    assert not (run_dir / "checkpoints" / "step-12").exists(), "run finished before the kill"
    assert 6 <= max(runs.losses(run_dir)) < STEPS

    code, out = runs.run(golden_llama_config(), run_dir, data_root, subprocess_env, nproc=1)
    assert code == 0, out
    assert f"resumed from {run_dir / 'checkpoints' / 'step-6'} at step 6" in out
    resumed = runs.losses(run_dir)
    # Steps 7..12 were recomputed after the resume: bit for bit those of the straight run.
    assert [resumed[s] for s in range(1, STEPS + 1)] == llama_runs["single"]
