"""Tiny Hugging Face folders built here from a config (nothing is downloaded), shared by the
tests and the benches that need a Qwen2-shaped model with a tokenizer of its own."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen2_tokenizer(
    folder: Path, lines: list[str], template: str, *, vocab_size: int, pad_token: str
) -> int:
    """A byte-level BPE tokenizer trained here on ``lines``, shaped as Qwen2's (transformers
    loads a qwen2 folder's tokenizer as its Qwen2Tokenizer: NFC, Qwen's split, byte-level),
    ``template`` in its tokenizer_config.json; its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
    )  # fmt: skip
    tok.train_from_iterator(lines, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": pad_token}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def qwen2_model(folder: Path, vocab: int, *, width: int, max_positions: int) -> None:
    """A 2-layer Qwen2 (4 heads, 2 KV heads, MLP twice ``width``, tied embeddings), seeded."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
