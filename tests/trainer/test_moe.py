"""The moe family (trainer/moe.py) under real torchrun (CPU, gloo): one process == DDP ==
FSDP2 with activation checkpointing == expert parallelism (4 ranks, experts split over pairs),
the router's metrics, exact resume from a checkpoint, and across expert-parallel sizes (an
EP run's checkpoint exports to Mixtral);
``train.init`` from a folder transformers' ``MixtralForCausalLM`` saved gives transformers'
first loss, its router aux loss included; a LoRA moe exports as PEFT adapters on Mixtral.
(Greedy decoding of the Mixtral export against transformers' ``generate``:
tests/trainer/test_generate.py's families.)"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import runs
from trainer.config import LoraConfig, TrainConfig
from trainer.lora import apply_lora, lora_param_count, targets_for
from trainer.models import build_model
from trainer.moe import MoE

MOE: dict[str, Any] = {
    "family": "moe",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
    "ffn_hidden": 48,
    "seq_len": 32,
    "vocab_size": 256,
    "n_experts": 4,
    "top_k": 2,
    "aux_loss_coef": 0.02,
    "router_z_loss_coef": 0.001,
}
STEPS = 6
EP = {"expert_parallel": 2}
ROUTER_METRICS = ("aux_loss", "router_z_loss", "expert_load_max", "expert_load_cv")


def moe_config(**overrides: Any) -> dict[str, Any]:
    cfg = runs.config(model=dict(MOE), steps=STEPS, eval={"every": 0})
    # two micro-batches of 4 rows a step (the same rows at any world size: BatchSampler)
    cfg["batch"] = {"micro_batch_size": 4, "grad_accum_steps": 2}
    cfg["checkpoint"] = {"every": 3, "keep": 2}
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def _model(**fields: Any) -> MoE:
    cfg = TrainConfig.model_validate({"model": {**MOE, **fields}}).model
    model = build_model(cfg)
    assert isinstance(model, MoE)
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def moe_runs(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("moe")
    half = {"micro_batch_size": 2, "grad_accum_steps": 2}
    configs = {
        "single": (moe_config(), 1),
        "ddp": (moe_config(batch=half), 2),
        "fsdp_ac": (moe_config(strategy="fsdp", batch=half, activation_checkpointing="full"), 2),
        # 4 ranks, the experts split over pairs of them: dispatch within a pair, the experts'
        # gradients summed across the pairs (and accumulated over the micro-batches)
        "ep": (moe_config(batch={"micro_batch_size": 1, "grad_accum_steps": 2}, **EP), 4),
    }
    for name, (cfg, n) in configs.items():
        code, out = runs.run(cfg, tmp / name, data_root, subprocess_env, nproc=n)
        assert code == 0, out
    return {name: tmp / name for name in configs}


def _losses(run_dir: Path) -> list[float]:
    got = runs.losses(run_dir)
    return [got[s] for s in sorted(got)]


def test_moe_trains_and_reports_its_router(moe_runs: dict[str, Path]) -> None:
    losses = _losses(moe_runs["single"])
    assert len(losses) == STEPS and losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert losses[-1] < losses[0] - 0.5, losses
    for record in runs.metrics(moe_runs["single"]):
        assert all(record[k] is not None for k in ROUTER_METRICS), record
        # top-2 of 4 experts: the busiest takes between a quarter and a half of the load
        assert 0.25 <= record["expert_load_max"] <= 0.5 and record["expert_load_cv"] >= 0
        # about top_k (2) when balanced, towards n_experts (4) as the router collapses
        assert 1.9 <= record["aux_loss"] <= 4, record


@pytest.mark.parametrize("other", ["ddp", "fsdp_ac", "ep"])
def test_moe_one_process_ddp_and_fsdp_with_ac_agree(moe_runs: dict[str, Path], other: str) -> None:
    single, got = runs.metrics(moe_runs["single"]), runs.metrics(moe_runs[other])
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in single], abs=1e-4)
    # the norm before clipping (under EP: the slices' squares summed over their group); the
    # clip engages (below), so a wrong scale would show in every later step's loss too
    norms = [r["grad_norm"] for r in single]
    assert max(norms) > moe_config()["optim"]["grad_clip"], norms
    assert [r["grad_norm"] for r in got] == pytest.approx(norms, abs=1e-4)
    for key in ROUTER_METRICS:  # summed over ranks and micro-batches: the same statistics
        assert [r[key] for r in got] == pytest.approx([r[key] for r in single], abs=1e-4), key


def test_moe_resumes_exactly(
    moe_runs: dict[str, Path], data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # The single run's step-3 checkpoint, alone: resuming from it recomputes steps 4..6.
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        moe_runs["single"] / "checkpoints" / "step-3", run_dir / "checkpoints" / "step-3"
    )
    code, out = runs.run(moe_config(), run_dir, data_root, subprocess_env, nproc=1)
    assert code == 0, out
    assert "at step 3" in out
    assert runs.metrics(run_dir)[-3:] != []
    straight = {r["step"]: r for r in runs.metrics(moe_runs["single"])}
    for r in runs.metrics(run_dir):
        assert r["loss"] == straight[r["step"]]["loss"]
        assert r["aux_loss"] == straight[r["step"]]["aux_loss"]


@pytest.mark.parametrize(
    ("source", "nproc", "extra"), [("ep", 1, {}), ("single", 2, EP), ("fsdp_ac", 2, EP)]
)
def test_moe_resumes_across_expert_parallel_sizes(
    moe_runs: dict[str, Path],
    data_root: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    source: str,
    nproc: int,
    extra: dict[str, Any],
) -> None:
    # EP=2's step-3 checkpoint resumed by one process (EP=1), one process's and FSDP2's
    # (dcp/) resumed with EP=2: steps 4..6 are the straight runs' (the experts are whole
    # in every checkpoint; each EP rank cuts its slice).
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(moe_runs[source] / "checkpoints" / "step-3", run_dir / "checkpoints" / "step-3")
    batch = {"micro_batch_size": 4 // nproc, "grad_accum_steps": 2}
    code, out = runs.run(moe_config(batch=batch, **extra), run_dir, data_root, subprocess_env,
                         nproc=nproc)  # fmt: skip
    assert code == 0, out
    assert "at step 3" in out
    resumed = runs.metrics(run_dir)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for straight in ("single", "ep"):
        want = {r["step"]: r for r in runs.metrics(moe_runs[straight])}
        for key in ("loss", "aux_loss"):
            got = [r[key] for r in resumed]
            assert got == pytest.approx([want[r["step"]][key] for r in resumed], abs=1e-4), key


def test_an_expert_parallel_run_exports_to_mixtral(
    moe_runs: dict[str, Path], tmp_path: Path
) -> None:
    # export checks transformers' MixtralForCausalLM's logits against ours (fails past 1e-4)
    pytest.importorskip("transformers")
    from trainer.export import export_checkpoint
    from trainer.restore import load_model

    diff, step = export_checkpoint(moe_runs["ep"], None, tmp_path / "hf", "hf")
    assert step == STEPS and diff <= 1e-4
    ep, _ = load_model(moe_runs["ep"])
    single, _ = load_model(moe_runs["single"])
    assert ep.blocks[0].feed_forward.w1.weight.shape[0] == MOE["n_experts"]
    for (name, a), b in zip(ep.state_dict().items(), single.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-4), name


def test_grouped_experts_compute_what_the_expert_loop_does() -> None:
    model = _model(n_experts=8, top_k=3)
    x = torch.randint(0, 256, (4, 32))
    outs = []
    for grouped in (True, False):
        model.set_grouped(grouped)
        model.zero_grad()
        loss = model(x, x) + model.router_loss()
        loss.backward()
        outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = outs
    assert a == pytest.approx(b.item(), abs=1e-6)
    assert max(float((p - q).abs().max()) for p, q in zip(ga, gb, strict=True)) < 1e-6


def test_moe_counts_active_parameters_as_the_plan_and_lora_adapts_attention_only() -> None:
    from trainer.plan import plan

    model = _model()
    per_layer_expert = 3 * 32 * 48
    assert model.expert_params() == 2 * 4 * per_layer_expert
    assert model.num_params() - model.active_params() == 2 * 2 * per_layer_expert
    spec = TrainConfig.model_validate({"model": MOE, "strategy": "fsdp"})
    counted = plan(spec, procs_per_node=2, nodes=1)
    assert counted["parameters"]["total"] == model.num_params()
    assert counted["parameters"]["active"] == model.active_params()
    lora_plan = plan(spec.model_copy(update={"lora": LoraConfig()}), procs_per_node=1, nodes=1)
    lora = LoraConfig()
    apply_lora(model, lora, targets_for(model.cfg, lora))
    trainable, _ = lora_param_count(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".attention." in n and "lora_" in n for n in names)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_plan["parameters"]["trainable"] == trainable


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny Mixtral built by transformers, saved as transformers saves it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=32,
        output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.MixtralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mixtral") / "tiny-mixtral"
    model.save_pretrained(folder)
    return model, folder


def test_init_from_mixtral_gives_transformers_first_loss_aux_included(
    mixtral: tuple[Any, Path], data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    theirs, folder = mixtral
    shutil.copytree(folder, data_root / "tiny-mixtral", dirs_exist_ok=True)
    # With LoRA on attention: its B starts at zero, so the first loss is the base's.
    cfg = moe_config(
        steps=2,
        init={"path": "tiny-mixtral"},
        model={**MOE, "router_z_loss_coef": 0.0},
        lora={"rank": 4, "alpha": 8.0},
        checkpoint={"every": 0, "keep": 1},
        batch={"micro_batch_size": 8, "grad_accum_steps": 1},  # the first batch, whole
    )
    code, out = runs.run(cfg, tmp_path / "run", data_root, subprocess_env, nproc=1)
    assert code == 0, out
    assert "LoRA: " in out, out
    first = runs.metrics(tmp_path / "run")[0]
    # The first batch, as the trainer's sampler draws it, through transformers' model.
    from trainer.data import BatchSampler, TokenDataset

    data = TokenDataset(data_root / "tiny", "train", 32, "tiny")
    x, y = BatchSampler(data, 8, 1, 0, 1, cfg["seed"]).batch(0, 0)[:2]
    with torch.no_grad():
        got = theirs(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    ce_theirs = got.loss - 0.02 * got.aux_loss
    assert first["aux_loss"] == pytest.approx(float(got.aux_loss), abs=1e-4)
    assert first["loss"] == pytest.approx(float(ce_theirs), abs=1e-4)
    assert first["loss"] + 0.02 * first["aux_loss"] == pytest.approx(float(got.loss), abs=1e-4)


def test_lora_moe_exports_peft_adapters_on_its_mixtral_base(
    mixtral: tuple[Any, Path], tmp_path: Path
) -> None:
    # write_hf and write_peft load their folders back (transformers' Mixtral; PEFT on it)
    # and fail past 1e-4 from our logits: with trained (non-zero) adapters here.
    pytest.importorskip("peft")
    from trainer.hf import write_hf, write_peft
    from trainer.lora import init_lora

    model, lora = _model(), LoraConfig(rank=4, alpha=8.0)
    base = tmp_path / "base"
    write_hf(model, base)
    apply_lora(model, lora, targets_for(model.cfg, lora))
    init_lora(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05)
    assert write_peft(model, tmp_path / "peft", lora, base_name=str(base)) <= 1e-4
