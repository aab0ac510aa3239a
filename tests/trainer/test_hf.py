"""trainer.hf and trainer.hf_io: our GPT and Llama compute what transformers' GPT2LMHeadModel and
LlamaForCausalLM compute with the same weights; ``--format hf`` exports load with
AutoModelForCausalLM; a run started from a Hugging Face folder or another job's checkpoint
(``init``) starts from exactly those weights, and one that does not fit fails before any
process group. Every Hugging Face model here is built from a config: nothing is downloaded.

Logits are compared at LOGIT_ATOL (fp32; the maps move tensors unchanged, and the two sides
agree to the last bit on these shapes), losses at LOSS_RTOL.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)
from transformers import (
    LlamaConfig as HFLlamaConfig,
)

from tests.trainer import runs
from trainer.__main__ import main as trainer_main
from trainer.config import ConfigError, InitConfig, LlamaConfig, ModelConfig, load_config
from trainer.data import BatchSampler, TokenDataset
from trainer.env import TrainerEnv
from trainer.events import ExitCode
from trainer.export import load_model
from trainer.export import main as export_main
from trainer.hf import check_init, load_init, write_hf
from trainer.hf_io import from_hf_state_dict, to_hf_state_dict
from trainer.models import build_model

LOGIT_ATOL = 1e-5
LOSS_RTOL = 1e-5
# The debug Llama: grouped-query attention (4 query heads, 2 key/value heads), tied embeddings.
LLAMA = {
    "family": "llama",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
    "seq_len": 32,
    "vocab_size": 256,
    "tie_embeddings": True,
}
JOB, OTHER = "a1b2", "c3d4"  # run folders are job ids


def _hf_llama(kv: int = 2, tie: bool = True, theta: float = 10000.0) -> LlamaForCausalLM:
    """The Llama that LLAMA describes, as transformers builds it (the config by hand, not
    trainer.hf's, so the map is checked against an independent statement of it)."""
    config = HFLlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=32,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
    )
    return _jitter(LlamaForCausalLM(config))


def _hf_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=256,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_inner=128,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _jitter(GPT2LMHeadModel(config))


def _jitter(model: Any, seed: int = 0) -> Any:
    """Every tensor moved off its initial value (norms off 1, biases off 0), so a norm or a
    bias mapped to the wrong place changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _tokens(batch: int = 3, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(7))


def _logits_equal(ours: Any, theirs: Any, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(
            ours(tokens), theirs(input_ids=tokens).logits, atol=LOGIT_ATOL, rtol=0
        )


@pytest.mark.parametrize(
    "kv, tie, theta", [(2, True, 10000.0), (4, False, 500.0)], ids=["gqa-tied", "mha-untied"]
)
def test_llama_computes_what_llama_for_causal_lm_computes(kv: int, tie: bool, theta: float) -> None:
    cfg = LlamaConfig.model_validate(
        {**LLAMA, "n_kv_head": kv, "tie_embeddings": tie, "rope_theta": theta}
    )
    theirs = _hf_llama(kv, tie, theta)
    ours = build_model(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(cfg, theirs.state_dict()))  # HF -> ours
    _logits_equal(ours, theirs, _tokens())

    torch.manual_seed(1)
    mine = build_model(cfg)
    mine.init_weights()
    _jitter(mine, seed=1)
    fresh = LlamaForCausalLM(theirs.config).eval()
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(mine), strict=False)  # ours -> HF
    assert (missing, unexpected) == (["lm_head.weight"] if tie else [], [])  # tied: stored once
    _logits_equal(mine, fresh, _tokens())


def test_gpt_computes_what_gpt2_computes_with_exact_gelu() -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=256)
    theirs = _hf_gpt2()
    ours = build_model(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(cfg, theirs.state_dict()))
    _logits_equal(ours, theirs, _tokens())

    torch.manual_seed(1)
    mine = build_model(cfg)
    mine.init_weights()
    _jitter(mine, seed=1)
    fresh = GPT2LMHeadModel(theirs.config).eval()
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(mine), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    _logits_equal(mine, fresh, _tokens())

    # OpenAI's own gpt2 files: GPT2Model's names (no "transformer."), causal-mask buffers.
    openai = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items()}
    openai |= {f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32) for i in range(2)}
    del openai["lm_head.weight"]
    again = build_model(cfg).eval()
    again.load_state_dict(from_hf_state_dict(cfg, openai))
    _logits_equal(again, theirs, _tokens())


def test_a_gpt2_with_tanh_gelu_is_taken_with_a_note(tmp_path: Path) -> None:
    """GPT-2's own gelu_new differs from our exact GELU by ~1e-3: not refused (fine-tuning
    adapts), but said."""
    model = _hf_gpt2()
    model.config.activation_function = "gelu_new"
    model.save_pretrained(tmp_path / "data" / "gpt2")
    cfg = load_config(runs.config(init={"path": "gpt2"}))
    notes = check_init(cfg, tmp_path / "runs" / JOB, tmp_path / "data")
    assert notes == [
        "init: gpt2 uses gelu_new (tanh GELU); trainq's GPT computes exact GELU, a slightly "
        "different function that fine-tuning adapts to"
    ]


@pytest.mark.parametrize("family", ["llama", "gpt2-sharded"])
def test_import_then_export_gives_the_same_tensors(family: str, tmp_path: Path) -> None:
    """save_pretrained -> our model (init.path) -> write_hf: the same tensors, the same names;
    the GPT-2 folder is sharded (model-*.safetensors and their index)."""
    source = tmp_path / "data" / "models" / "src"
    if family == "llama":
        cfg: Any = LlamaConfig.model_validate(LLAMA)
        _hf_llama().save_pretrained(source)
    else:
        cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=256)
        _hf_gpt2().save_pretrained(source, max_shard_size="40KB")
        assert len(list(source.glob("model-*.safetensors"))) > 1
    model = build_model(cfg)
    load_init(model, InitConfig(path="models/src"), tmp_path / "data", tmp_path / "runs" / JOB)
    write_hf(model, tmp_path / "out")
    before: dict[str, torch.Tensor] = {}
    for shard in source.glob("*.safetensors"):
        before.update(load_file(shard))
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


# -- runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with the tiny corpus and a Llama saved by transformers (models/llama)."""
    root = tmp_path_factory.mktemp("hf-data")
    runs.write_corpus(root)
    _hf_llama().save_pretrained(root / "models" / "llama")
    return root


def _start_run(
    cfg: dict[str, Any], run_dir: Path, root: Path, env: dict[str, str], nproc: int
) -> tuple[int, str]:
    # The working directory is the data root: a relative init.path names the same folder
    # whether the trainer resolves it against --data-root or, run by hand, against the cwd.
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / f"{run_dir.name}.json"
    cfg_path.write_text(json.dumps(cfg))
    done = subprocess.run(
        runs.argv(cfg_path, run_dir, root, nproc),
        env=env,
        cwd=root,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
    )
    return done.returncode, done.stdout


def _step0_loss(model: Any, cfg: dict[str, Any], root: Path, world: int) -> float:
    """The loss a run logs at step 1, by hand: every rank's micro-batches of step 0, averaged."""
    c = load_config(cfg)
    data = TokenDataset(root / c.data.path, "train", c.model.seq_len)
    losses = []
    with torch.no_grad():
        for rank in range(world):
            sampler = BatchSampler(
                data, c.batch.micro_batch_size, c.batch.grad_accum_steps, rank, world, c.seed
            )
            for micro in range(c.batch.grad_accum_steps):
                x, y = sampler.batch(0, micro)
                out = model(x)
                logits = getattr(out, "logits", out)  # transformers' output, or our logits
                losses.append(float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))))
    return sum(losses) / len(losses)


FT = runs.fsdp_config(
    model=LLAMA, steps=2, eval={"every": 0}, checkpoint={"every": 0}, init={"path": "models/llama"}
)


@pytest.fixture(scope="module")
def llama_run(
    tmp_path_factory: pytest.TempPathFactory, hf_root: Path, subprocess_env: dict[str, str]
) -> Path:
    """2-rank FSDP2 fine-tuning of models/llama (rank 0's full model feeds the shards)."""
    run_dir = tmp_path_factory.mktemp("hf-runs") / JOB
    code, out = _start_run(FT, run_dir, hf_root, subprocess_env, nproc=2)
    assert code == 0, out
    return run_dir


def test_fine_tuning_starts_from_the_hugging_face_weights(llama_run: Path, hf_root: Path) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(hf_root / "models" / "llama").eval()
    expected = _step0_loss(theirs, FT, hf_root, world=2)
    first = runs.losses(llama_run)[1]
    assert first == pytest.approx(expected, rel=LOSS_RTOL)


@pytest.mark.parametrize("fixture", ["ddp_run", "fsdp_run", "llama_run"])
def test_export_hf_loads_with_auto_model(
    fixture: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir: Path = request.getfixturevalue(fixture)
    out = tmp_path / "exports" / "hf"
    assert export_main(["--run-dir", str(run_dir), "--out", str(out), "--format", "hf"]) == 0
    assert f"to {out} (hf); max |logit diff|" in capsys.readouterr().out
    assert runs.wrong_modes(tmp_path / "exports") == {}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(loaded).__name__ == (
        "LlamaForCausalLM" if fixture == "llama_run" else "GPT2LMHeadModel"
    )
    model, _ = load_model(run_dir)
    _logits_equal(model, loaded, _tokens(5, 11))  # not the shape write_hf checked


def test_init_from_a_jobs_checkpoint_then_resume_wins(
    fsdp_run: Path, tmp_path: Path, data_root: Path, subprocess_env: dict[str, str]
) -> None:
    """init.job reads another run's checkpoint (FSDP's sharded one, at init.step) on every
    rank of a 2-rank DDP run, inside its process group; the new run's first loss is that
    model's on the new run's first batches. Once the new run has a checkpoint of its own, a
    restart resumes from it: the init source is not read again."""
    source = tmp_path / "runs" / JOB
    shutil.copytree(fsdp_run / "checkpoints", source / "checkpoints")
    cfg = runs.config(steps=1, eval={"every": 0}, init={"job": JOB, "step": 10})
    code, out = _start_run(cfg, tmp_path / "runs" / OTHER, data_root, subprocess_env, nproc=2)
    assert code == 0, out
    old, _ = load_model(fsdp_run, fsdp_run / "checkpoints" / "step-10")
    expected = _step0_loss(old, cfg, data_root, world=2)
    assert runs.losses(tmp_path / "runs" / OTHER)[1] == pytest.approx(expected, rel=LOSS_RTOL)

    shutil.rmtree(source)  # would be a spec_error if init were read again
    code, out = _start_run(
        {**cfg, "steps": 2}, tmp_path / "runs" / OTHER, data_root, subprocess_env, nproc=2
    )
    assert code == 0, out
    assert "resumed from" in out and sorted(runs.losses(tmp_path / "runs" / OTHER)) == [1, 2]


def test_init_from_a_job_takes_its_weights_and_leaves_the_rng_alone(
    ddp_run: Path, tmp_path: Path
) -> None:
    """A DDP checkpoint (model.pt), its newest step; building that model to read it draws
    weights, which must not move what the trainer draws next (LoRA's adapters)."""
    shutil.copytree(ddp_run / "checkpoints", tmp_path / "runs" / JOB / "checkpoints")
    model = build_model(load_config(runs.config()).model)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    load_init(model, InitConfig(job=JOB), None, tmp_path / "runs" / OTHER)
    assert torch.equal(torch.get_rng_state(), before)
    reference, step = load_model(ddp_run)
    assert step == 20
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


# -- what does not fit ---------------------------------------------------------------------


def test_a_shape_mismatch_is_a_spec_error_before_any_process_group(
    hf_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """models/llama has 2 key/value heads ([16, 32] projections); a model with 4 wants
    [32, 32]. The trainer says so in one line and exit.json; and train() raises it before it
    would join a process group (a 2-rank env with no rendezvous: joining would fail otherwise)."""
    cfg = runs.config(model={**LLAMA, "n_kv_head": 4}, init={"path": "models/llama"})
    monkeypatch.chdir(hf_root)  # see _start_run
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(cfg))
    args = ["--config", str(cfg_path), "--run-dir", str(tmp_path / "run"), "--data-root"]
    assert trainer_main([*args, str(hf_root)]) == ExitCode.SPEC_ERROR
    err = capsys.readouterr().err
    pattern = (
        r"init: model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 32\] in "
        r"\S*models/llama but \[32, 32\] in this model"
    )
    assert re.search(pattern, err) and err.count("\n") == 1, err
    info = json.loads((tmp_path / "run" / "exit.json").read_text())
    assert info["reason"] == "spec_error" and re.search(pattern, info["message"])
    assert "v_proj.weight has shape [16, 32]" in info["message"]

    from trainer.train import train

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # joining fails at once, never waits
        monkeypatch.delenv(name, raising=False)
    env = TrainerEnv(rank=0, world_size=2, distributed=True)
    with pytest.raises(ConfigError, match="k_proj"):
        train(load_config(cfg), tmp_path / "run2", hf_root / "tiny", env)
    assert not torch.distributed.is_initialized()


# Hugging Face folders that do not fit LLAMA, by the name init.path gives them.
MISFITS = {
    "gpt2": _hf_gpt2,
    "untied": lambda: _hf_llama(tie=False),
    "theta": lambda: _hf_llama(theta=500.0),
}


@pytest.mark.parametrize(
    "init, message",
    [
        (
            {"path": "models/gpt2"},
            r"models/gpt2 is a 'gpt2' model \(config.json model_type\) but this "
            r"run trains family llama",
        ),
        (
            {"path": "models/untied"},
            r"models/untied has tie_word_embeddings False \(config.json\) but "
            r"model.tie_embeddings is True",
        ),
        (
            {"path": "models/theta"},
            r"models/theta has rope_theta 500.0 \(config.json\) but model.rope_theta is 10000.0",
        ),
        ({"path": "models/missing"}, r"init.path 'models/missing' is not a folder under the data"),
        ({"job": "ffff"}, r"init.job 'ffff': no such job has a run folder here"),
        ({"job": JOB, "step": 3}, r"init.job 'a1b2' has no checkpoint at step 3 \(10, 20 only\)"),
        ({"job": OTHER}, r"job c3d4 step 20 trained family gpt but this run trains family llama"),
    ],
    ids=["gpt2-folder", "untied-folder", "rope-theta", "no-folder", "no-job", "no-step", "gpt-job"],
)
def test_what_does_not_fit_is_named(
    init: dict[str, Any], message: str, tmp_path: Path, ddp_run: Path
) -> None:
    """check_init, as the trainer runs it before any process group: a source that is not
    there, or one that computes another function though its shapes may fit."""
    root = tmp_path / "data"
    name = Path(init.get("path", "")).name
    if name in MISFITS:
        MISFITS[name]().save_pretrained(root / "models" / name)
    for job in (JOB, OTHER):
        shutil.copytree(ddp_run / "checkpoints", tmp_path / "runs" / job / "checkpoints")
    cfg = load_config(runs.config(model=LLAMA, init=init))
    with pytest.raises(ConfigError, match=message):
        check_init(cfg, tmp_path / "runs" / "e5f6", root)


def test_init_path_may_not_leave_the_data_root(tmp_path: Path) -> None:
    cfg = load_config(runs.config(model=LLAMA, init={"path": "../outside"}))
    for folder in ("data", "outside"):
        (tmp_path / folder).mkdir()
    with pytest.raises(ConfigError, match=r"init.path '../outside' must be a plain relative path"):
        check_init(cfg, tmp_path / "runs" / JOB, tmp_path / "data")


def test_the_trainer_resolves_init_path_against_the_data_root(
    hf_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    runs.write_corpus(root)
    shutil.copytree(hf_root / "models" / "llama", tmp_path / "outside")
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(runs.config(model=LLAMA, init={"path": "../outside"})))
    args = ["--config", str(cfg_path), "--run-dir", str(tmp_path / "run"), "--data-root"]
    assert trainer_main([*args, str(root)]) == ExitCode.SPEC_ERROR
    assert "init.path '../outside' must be a plain relative path" in capsys.readouterr().err
