"""Exports of every family and every way of training, loaded by the outside clients.

One short LoRA run per family (gpt, llama, and hf: a tiny Qwen2 made here with
save_pretrained from a config; nothing is downloaded) ends with the trainer's own exports
(trainer.publish: step-N/hf and step-N/peft). Each test loads them as a user would:
transformers' AutoModelForCausalLM gives trainq's logits; PEFT's adapter on its base gives
the merged export's logits; AutoTokenizer round-trips multilingual text with an emoji. The
gpt and llama runs train on bytes (the export carries a byte-level tokenizer), the hf run on
a byte-level BPE tokenizer with an end-of-text token (bos/eos/pad declared in the export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import runs
from tests.trainer.test_llama import LLAMA

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = [
    pytest.mark.timeout(300),
    # peft 0.21 asks transformers 5 a deprecated question; neither is ours
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TEXT = "héllo wörld 你好 🎉\n\t  spaces"
EOT = "<|endoftext|>"
LORA = {"rank": 4, "alpha": 8.0}
GPT = dict(runs.DEBUG_CONFIG["model"])


def _bpe_tokenizer(path: Path, lines: list[str]) -> None:
    """A byte-level BPE tokenizer trained here (about 300 tokens), end-of-text special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOT, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.prepare import prepare

    root = tmp_path_factory.mktemp("export-families")
    data = root / "data"
    runs.write_corpus(data)
    lines = [" ".join(runs.WORDS[i:] + runs.WORDS[:i]) + f"{EOT}\n" for i in range(14)]
    tokenizer = root / "bpe.json"
    _bpe_tokenizer(tokenizer, lines)
    text = root / "words.txt"
    text.write_text("".join(lines * 40))
    prepare([text], data / "bpe", tokenizer=tokenizer)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    Qwen2ForCausalLM(config).save_pretrained(data / "models" / "qwen")
    return {"data": data, "runs": root / "runs"}


def _config(family: str) -> dict[str, Any]:
    model = {"gpt": GPT, "llama": LLAMA}.get(family)
    cfg = runs.config(steps=4, eval={"every": 0}, checkpoint={"every": 0, "keep": 1, "hf": "final"})
    cfg["batch"] = {"micro_batch_size": 4, "grad_accum_steps": 1}
    cfg["optim"] = {**cfg["optim"], "lr": 5e-2}
    cfg["lora"] = dict(LORA)
    if model is None:
        cfg["model"] = {"family": "hf", "path": "models/qwen", "seq_len": 32}
        cfg["data"] = {"path": "bpe"}
    else:
        cfg["model"] = dict(model)
    return cfg


@pytest.fixture(scope="module")
def trained(roots: dict[str, Path], subprocess_env: dict[str, str]) -> dict[str, Path]:
    """family -> its run's final checkpoint (step-4), with hf/ and peft/ written."""
    out = {}
    for family in ("gpt", "llama", "hf"):
        run_dir = roots["runs"] / family
        run_dir.mkdir(parents=True)  # the spec as the worker writes it, model.path as spelled
        (run_dir / "config.json").write_text(json.dumps(_config(family)))
        code, log = runs.run(_config(family), run_dir, roots["data"], subprocess_env, nproc=1)
        assert code == 0, log
        assert "hf: wrote" in log and "peft: wrote" in log, log
        out[family] = run_dir / "checkpoints" / "step-4"
    return out


def _tokens(vocab: int, batch: int = 3, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


FAMILIES = ["gpt", "llama", "hf"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_gives_trainqs_logits(family: str, trained: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.export import load_model

    step = trained[family]
    ours, _ = load_model(step.parent.parent, step)  # LoRA merged
    loaded = AutoModelForCausalLM.from_pretrained(step / "hf", local_files_only=True).eval()
    assert loaded.dtype == torch.float32
    tokens = _tokens(loaded.config.vocab_size)
    with torch.no_grad():
        diff = (loaded(input_ids=tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-4
    # The adapters trained: the merged weights are not the base's.
    base, _ = load_model(step.parent.parent, step, merge=False)
    from trainer.lora import drop_lora

    drop_lora(base)
    with torch.no_grad():
        assert (base(tokens) - ours(tokens)).abs().max().item() > 1e-3


def _base_folder(family: str, step: Path, roots: dict[str, Path], tmp: Path) -> Path:
    """What the adapter loads on: family hf's model.path; gpt/llama: `--format hf --base`."""
    if family == "hf":
        return roots["data"] / "models" / "qwen"
    from trainer.export import main as export_main

    out = tmp / "base"
    argv = ["--checkpoint", str(step), "--out", str(out), "--format", "hf", "--base"]
    assert export_main([*argv, "--data-root", str(roots["data"])]) == 0
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_on_its_base_equals_the_merged_export(
    family: str, trained: dict[str, Path], roots: dict[str, Path], tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    step = trained[family]
    peft_dir = step / "peft"
    settings = json.loads((peft_dir / "adapter_config.json").read_text())
    assert settings["peft_type"] == "LORA" and settings["task_type"] == "CAUSAL_LM"
    assert settings["r"] == LORA["rank"] and settings["lora_alpha"] == LORA["alpha"]
    # GPT-2's mlp.c_proj is not adapted, so "c_proj" alone would pick too much: full names.
    gpt = [f"transformer.h.{i}.attn.c_{n}" for i in (0, 1) for n in ("attn", "proj")]
    short = ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert settings["target_modules"] == (gpt if family == "gpt" else short)
    assert settings["fan_in_fan_out"] is (family == "gpt")
    assert settings["base_model_name_or_path"] == ("models/qwen" if family == "hf" else None)
    with safe_open(str(peft_dir / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    layer = {"gpt": "transformer.h.0.attn.c_attn", "llama": "model.layers.0.self_attn.q_proj"}
    name = layer.get(family, layer["llama"])
    assert f"base_model.model.{name}.lora_A.weight" in keys
    assert f"base_model.model.{name}.lora_B.weight" in keys
    assert all(k.startswith("base_model.model.") for k in keys)

    base = AutoModelForCausalLM.from_pretrained(
        _base_folder(family, step, roots, tmp_path), local_files_only=True, dtype=torch.float32
    )
    adapted = PeftModel.from_pretrained(base, peft_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(step / "hf", local_files_only=True).eval()
    tokens = _tokens(merged.config.vocab_size)
    with torch.no_grad():
        want = merged(input_ids=tokens).logits
        got = adapted(input_ids=tokens).logits
        assert (got - want).abs().max().item() <= 1e-4
        without = adapted.get_base_model()
        with adapted.disable_adapter():  # the adapters are what makes the difference
            assert (without(input_ids=tokens).logits - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["hf", "peft"])
def test_auto_tokenizer_round_trips_the_runs_text(
    family: str, fmt: str, trained: dict[str, Path], roots: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained[family] / fmt, local_files_only=True)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    if family != "hf":  # byte-level: 256 tokens, the ids are the UTF-8 bytes, no unk
        assert ids == list(TEXT.encode("utf-8"))
        assert len(tok) == 256 and tok.unk_token is None
        # NUL is declared as eos for tools that need one special token (lm-eval's prefix)
        assert tok.eos_token_id == 0 and tok.decode([0]) == "\x00"
        return
    from tokenizers import Tokenizer

    dataset = Tokenizer.from_file(str(roots["data"] / "bpe" / "tokenizer.json"))
    assert ids == dataset.encode(TEXT, add_special_tokens=False).ids
    eot, pad = dataset.token_to_id(EOT), dataset.token_to_id("<pad>")
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == (EOT, eot, pad)


def test_hf_export_declares_eos_so_generate_stops_there(
    trained: dict[str, Path], roots: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trainer.tokenizer import eos_ids

    folder = trained["hf"] / "hf"
    from tokenizers import Tokenizer

    eot = eos_ids(roots["data"] / "bpe")
    dataset = Tokenizer.from_file(str(roots["data"] / "bpe" / "tokenizer.json"))
    assert eot == [dataset.token_to_id(EOT)]
    gen = GenerationConfig.from_pretrained(folder)
    assert gen.eos_token_id == eot[0] and gen.pad_token_id == dataset.token_to_id("<pad>")
    config = json.loads((folder / "config.json").read_text())  # not Qwen2's own 151643
    assert config["eos_token_id"] == eot[0] and config["bos_token_id"] is None
    for family in ("gpt", "llama"):  # bytes: nothing to stop at, nothing claimed
        assert not (trained[family] / "hf" / "generation_config.json").exists()
    assert eos_ids(roots["data"] / "tiny") == []  # bytes: no eos
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():  # the eos made the likeliest token: generation stops on it
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        model.lm_head.bias[eot[0]] = 1e4
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False)
    assert out[0].tolist() == [5, 6, 7, eot[0]]


def test_a_run_without_adapters_has_no_peft_export(tmp_path: Path, ddp_run: Path) -> None:
    from trainer.export import main as export_main

    out = tmp_path / "peft"
    code = export_main(["--run-dir", str(ddp_run), "--out", str(out), "--format", "peft"])
    assert code == 1 and not out.exists()


def test_export_cli_writes_what_the_trainer_published(
    trained: dict[str, Path], roots: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    """`python -m trainer.export --format peft` of the hf run: the same adapter and config
    as the run's own step-N/peft, checked with PEFT on load-back."""
    from safetensors.torch import load_file

    from trainer.export import main as export_main

    step = trained["hf"]
    out = tmp_path / "adapter"
    argv = ["--run-dir", str(step.parent.parent), "--out", str(out), "--format", "peft"]
    assert export_main([*argv, "--data-root", str(roots["data"])]) == 0
    assert "(peft); max |logit diff|" in capsys.readouterr().out
    assert runs.wrong_modes(tmp_path) == {}
    for name in ("adapter_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_text() == (step / "peft" / name).read_text(), name
    ours, published = (load_file(p / "adapter_model.safetensors") for p in (out, step / "peft"))
    assert ours.keys() == published.keys()
    assert all(torch.equal(ours[k], published[k]) for k in ours)
