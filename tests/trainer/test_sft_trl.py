"""trainq's SFT against the reference: TRL's ``SFTTrainer`` with ``assistant_only_loss``.

A tiny Qwen2 built from a config (weights saved), a BPE tokenizer trained here, a chat
template with ``{% generation %}`` markers, a dozen conversations of different lengths: the
first step of a real trainq run (family hf, packed, one step over every example) has TRL's
loss and gradient norm within 1e-5. TRL runs offline on the CPU, in fp32, on its own
tokenization, masking, padding and loss (``training_step``: what ``train`` runs each step).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer import runs
from trainer.data import TokenDataset
from trainer.prepare import prepare_sft

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
)
SEQ = 128


def _conversations(n: int) -> list[list[dict[str, str]]]:
    rng = np.random.default_rng(5)
    words = runs.WORDS

    def text(lo: int, hi: int) -> str:
        return " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(lo, hi)))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "answer in words"}]
        for _ in range(int(rng.integers(1, 3))):
            messages += [
                {"role": "user", "content": text(2, 8)},
                {"role": "assistant", "content": text(1, 6)},
            ]
        out.append(messages)
    return out


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=specials)
    corpus = " ".join(runs.WORDS) + " user assistant system answer in words"
    tok.train_from_iterator([corpus] * 20, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _qwen2(folder: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)


def _trl_first_step(model_dir: Path, tok_dir: Path, chats: list, out: Path) -> tuple[float, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=len(chats), max_steps=1,
        assistant_only_loss=True, max_length=None, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", seed=0, dataloader_drop_last=False,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"messages": m} for m in chats]),
    )  # fmt: skip
    batches, items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, "cpu")
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] == len(chats)
    model.train()
    loss = trainer.training_step(model, batches[0], items)
    grads = [p.grad.double().norm() ** 2 for p in model.parameters() if p.grad is not None]
    return float(loss), float(torch.stack(grads).sum().sqrt())


# TRL's own config trips transformers' deprecation warnings (gradient_checkpointing)
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_first_step_equals_trls_sft_trainer(
    tmp_path: Path, subprocess_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = tmp_path / "root"
    _tokenizer(root / "tok")
    _qwen2(root / "qwen")
    chats = _conversations(12)
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": m}) for m in chats) + "\n")
    prepare_sft([src], root / "chat", "chat", tokenizer=root / "tok" / "tokenizer.json",
                val_fraction=0.0)  # fmt: skip
    rows = TokenDataset(root / "chat", "train", SEQ, packing=True).num_samples
    assert rows < len(chats)  # packed: several conversations a row
    cfg = runs.config(
        steps=1, seed=0,
        data={"path": "chat", "packing": True},
        batch={"micro_batch_size": rows, "grad_accum_steps": 1},
        optim={"lr": 1e-3, "warmup_steps": 0, "grad_clip": 1e6},
        eval={"every": 0}, checkpoint={"every": 0, "hf": "none"},
    )  # fmt: skip
    cfg["model"] = {"family": "hf", "path": "qwen", "seq_len": SEQ}
    code, out = runs.run(cfg, tmp_path / "run", root, subprocess_env, nproc=1)
    assert code == 0, out
    first = runs.metrics(tmp_path / "run")[0]

    loss, grad_norm = _trl_first_step(root / "qwen", root / "tok", chats, tmp_path / "trl")
    assert first["loss"] == pytest.approx(loss, abs=1e-5, rel=0)
    assert first["grad_norm"] == pytest.approx(grad_norm, abs=1e-5, rel=1e-5)
    assert loss > 1.0  # a real loss: near ln(vocab) at init
