"""LoRA (trainer/lora.py): only the adapters train; an adapted model starts as its base; the
merged model computes what base + adapters did; and under real torchrun one process, DDP
and FSDP2 (frozen and trainable parameters in one FSDP unit) give the same losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import runs
from tests.trainer.test_llama import LLAMA
from trainer.config import LoraConfig, TrainConfig
from trainer.lora import apply_lora, init_lora, lora_param_count, merge_lora, targets_for
from trainer.models import build_model

LORA = {"rank": 4, "alpha": 8.0}


def _llama(seed: int = 0) -> Any:
    cfg = TrainConfig.model_validate({"model": LLAMA, "lora": LORA})
    torch.manual_seed(seed)
    model: Any = build_model(cfg.model)
    model.init_weights()
    return model, cfg


def test_only_the_adapters_train_and_the_model_starts_as_its_base() -> None:
    model, cfg = _llama()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = model(x)
    assert cfg.lora is not None
    adapted = apply_lora(model, cfg.lora, targets_for(cfg.model, cfg.lora))
    init_lora(model)
    assert adapted == 2 * 4  # wq, wk, wv, wo in each of the 2 blocks
    trainable, total = lora_param_count(model)
    # rank * (in + out) per adapted linear: wq/wo 32x32, wk/wv 16x32 (2 kv heads of 8)
    per_block = 4 * (32 + 32) * 2 + 4 * (32 + 16) * 2
    assert trainable == 2 * per_block
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"blocks.{i}.attention.{w}.lora_{ab}"
        for i in range(2)
        for w in ("wq", "wk", "wv", "wo")
        for ab in "ab"
    }
    assert total == trainable + _llama()[0].num_params()
    with torch.no_grad():
        assert torch.equal(model(x), before)  # B = 0: the base's output exactly


def test_merged_model_computes_base_plus_adapters() -> None:
    model, cfg = _llama()
    assert cfg.lora is not None
    apply_lora(model, cfg.lora, targets_for(cfg.model, cfg.lora))
    init_lora(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)  # as if trained
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        adapted = model(x)
        merge_lora(model)
        merged = model(x)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert set(model.state_dict()) == set(_llama()[0].state_dict())
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)


def test_a_target_that_matches_nothing_is_refused() -> None:
    model, _ = _llama()
    with pytest.raises(ValueError, match="match no linear"):
        apply_lora(model, LoraConfig(targets=["nope"]), ("nope",))


def lora_config(**overrides: Any) -> dict[str, Any]:
    cfg = runs.config(model=dict(LLAMA), steps=8, eval={"every": 0})
    cfg["checkpoint"] = {"every": 0, "keep": 1}
    cfg["lora"] = dict(LORA)
    cfg["optim"] = {**cfg["optim"], "lr": 3e-2}
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def lora_runs(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora")
    configs = {
        "single": (lora_config(batch={"micro_batch_size": 8, "grad_accum_steps": 1}), 1),
        "ddp": (lora_config(), 2),
        "fsdp": (
            lora_config(
                strategy="fsdp",
                batch={"micro_batch_size": 2, "grad_accum_steps": 2},
                activation_checkpointing="full",
            ),
            2,
        ),
    }
    for name, (cfg, n) in configs.items():
        code, out = runs.run(cfg, tmp / name, data_root, subprocess_env, nproc=n)
        assert code == 0, out
        assert "trainable" in out, out  # the trainable share is reported
    return {name: tmp / name for name in configs}


def _series(run_dir: Path) -> list[float]:
    got = runs.losses(run_dir)
    return [got[s] for s in sorted(got)]


@pytest.mark.parametrize("other", ["ddp", "fsdp"])
def test_lora_one_process_ddp_fsdp_agree(lora_runs: dict[str, Path], other: str) -> None:
    single, got = _series(lora_runs["single"]), _series(lora_runs[other])
    assert got[:4] == pytest.approx(single[:4], rel=1e-5, abs=0)
    assert got == pytest.approx(single, rel=1e-4, abs=0)
    assert single[-1] < single[0] - 0.1, single  # the adapters alone move the loss


def test_lora_changes_only_the_adapters(lora_runs: dict[str, Path]) -> None:
    from trainer.export import load_model

    trained, _ = load_model(lora_runs["ddp"], merge=False)
    base, _ = _llama(seed=runs.DEBUG_CONFIG["seed"])
    state, start = trained.state_dict(), base.state_dict()
    assert set(start) < set(state)
    for name, tensor in start.items():
        assert torch.equal(state[name], tensor), f"{name} changed"
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in state.items() if "lora_b" in k)
