"""The ``hf`` family: a tiny Qwen2-style model that transformers builds from a local folder
(made here from a config with ``save_pretrained``; nothing is downloaded) trains under one
process, DDP and FSDP2 with the same losses; a folder with only config.json starts from
fresh weights; a folder that is not a model is a spec_error before any rank trains."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainer import runs

pytest.importorskip("transformers")

STEPS = 8


@pytest.fixture(scope="module")
def model_folders(data_root: Path) -> dict[str, str]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    pretrained = data_root / "models" / "qwen-tiny"
    Qwen2ForCausalLM(config).save_pretrained(pretrained)
    fresh = data_root / "models" / "qwen-config-only"
    config.save_pretrained(fresh)
    (data_root / "models" / "not-a-model").mkdir(exist_ok=True)
    return {"pretrained": "models/qwen-tiny", "fresh": "models/qwen-config-only"}


def hf_config(path: str, **overrides: Any) -> dict[str, Any]:
    cfg = runs.config(steps=STEPS, eval={"every": 0}, checkpoint={"every": 0, "keep": 1})
    cfg["model"] = {"family": "hf", "path": path, "seq_len": 32}
    cfg.update(overrides)
    return cfg


def _losses(
    tmp: Path, name: str, cfg: dict[str, Any], data_root: Path, env: Any, n: int
) -> list[float]:
    return runs.run_losses(cfg, tmp / name, data_root, env, n)


@pytest.fixture(scope="module")
def hf_runs(
    tmp_path_factory: pytest.TempPathFactory,
    data_root: Path,
    subprocess_env: dict[str, str],
    model_folders: dict[str, str],
) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("hf")
    path = model_folders["pretrained"]
    fsdp = {"strategy": "fsdp", "batch": {"micro_batch_size": 2, "grad_accum_steps": 2}}
    env = subprocess_env
    return {
        "single": _losses(
            tmp, "single", hf_config(path, batch={"micro_batch_size": 8}), data_root, env, 1
        ),
        "ddp": _losses(tmp, "ddp", hf_config(path), data_root, env, 2),
        "fsdp": _losses(
            tmp, "fsdp", hf_config(path, **fsdp, activation_checkpointing="full"), data_root, env, 2
        ),
        "fresh": _losses(
            tmp,
            "fresh",
            hf_config(model_folders["fresh"], batch={"micro_batch_size": 8}),
            data_root,
            env,
            1,
        ),
    }


@pytest.mark.parametrize("other", ["ddp", "fsdp"])
def test_hf_model_one_process_ddp_fsdp_agree(hf_runs: dict[str, list[float]], other: str) -> None:
    single, got = hf_runs["single"], hf_runs[other]
    assert len(single) == STEPS
    assert got[:4] == pytest.approx(single[:4], rel=1e-5, abs=0)
    assert got == pytest.approx(single, rel=1e-4, abs=0)
    assert single[-1] < single[0]


def test_a_folder_with_weights_starts_from_them(hf_runs: dict[str, list[float]]) -> None:
    # Both start near ln(256) (tiny models, small init); they differ from the first step on
    # because one starts from the saved weights and the other draws its own from the seed.
    assert hf_runs["fresh"][0] == pytest.approx(math.log(256), abs=0.2)
    assert hf_runs["fresh"][0] != pytest.approx(hf_runs["single"][0], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "needle"),
    [("models/not-a-model", "has no config.json"), ("models/absent", "is not a folder")],
)
def test_a_folder_that_is_not_a_model_is_a_spec_error(
    tmp_path: Path,
    data_root: Path,
    subprocess_env: dict[str, str],
    model_folders: dict[str, str],
    path: str,
    needle: str,
) -> None:
    code, _ = runs.run(hf_config(path), tmp_path / "bad", data_root, subprocess_env, nproc=1)
    assert code != 0
    verdict = json.loads((tmp_path / "bad" / "exit.json").read_text())
    assert verdict["reason"] == "spec_error" and needle in verdict["message"], verdict
