"""trainer.model, in process: sizes, FLOPs, init, causality; and the optimizer and lr schedule."""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig, load_config
from trainer.model import GPT
from trainer.train import build_optimizer, lr_at

CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=256)


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights()
    return model


def test_num_params_counts_the_tied_head_once() -> None:
    d, v, t, L = 32, 256, 32, 2
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = v * d + t * d + L * block + 2 * d
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == expected
    assert model.num_params(exclude_embedding=True) == expected - v * d - t * d


def test_flops_per_token_is_6n_plus_attention() -> None:
    model = _model()
    n = model.num_params() - 32 * 32  # the position table does no matmul
    assert model.flops_per_token() == 6 * n + 12 * 2 * 2 * 16 * 32


def test_init_is_seeded_and_scaled() -> None:
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)
    big = _model(ModelConfig(n_layer=8, n_head=4, d_model=256, seq_len=64, vocab_size=512))
    p = dict(big.named_parameters())
    assert p["blocks.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    # Residual projections: 0.02 / sqrt(2 * n_layer) = 0.005.
    assert p["blocks.3.mlp.proj.weight"].std().item() == pytest.approx(0.005, rel=0.05)
    assert p["blocks.3.attn.proj.weight"].std().item() == pytest.approx(0.005, rel=0.05)
    assert torch.equal(p["ln_f.weight"], torch.ones(256))
    assert torch.count_nonzero(p["blocks.0.mlp.fc.bias"]) == 0


def test_initial_loss_is_uniform_and_attention_is_causal() -> None:
    model = _model()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(x, torch.roll(x, -1, dims=1))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert torch.allclose(before[:, :20], after[:, :20], atol=1e-6)  # the past cannot see ahead
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_model_module_does_not_import_torch_distributed() -> None:
    tree = ast.parse((Path(__file__).parents[2] / "trainer" / "model.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "torch" in imported
    assert not [m for m in imported if m.startswith("torch.distributed")]


def test_optimizer_decays_only_matmul_weights() -> None:
    model = _model()
    cfg = load_config({"optim": {"weight_decay": 0.1}})
    opt = build_optimizer(model, cfg.optim)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {
        n
        for n, p in model.named_parameters()
        if p.ndim == 2 and n not in ("wte.weight", "wpe.weight")
    }
    assert "blocks.0.attn.qkv.weight" in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_lr_warms_up_then_follows_cosine_to_the_floor() -> None:
    cfg = load_config({"steps": 110, "optim": {"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1}})
    lrs = [lr_at(s, cfg) for s in range(110)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    no_warmup = load_config({"steps": 10, "optim": {"lr": 2.0, "warmup_steps": 0}})
    assert lr_at(0, no_warmup) == pytest.approx(2.0)
