"""trainer.generate without the service: the KV cache decodes what the full forward does,
greedy decoding of our gpt, llama and moe equals transformers' generate on their Hugging Face
export, a seed repeats, and streamed text never splits a UTF-8 character.

The models are tiny and drawn from a seed, their weights scaled up so the next token is
decided by a clear margin (random small weights give near-uniform logits, where the argmax
would turn on the last bit of a float).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.config import HFModelConfig, LlamaConfig, ModelConfig, MoeConfig
from trainer.generate import (
    ByteTokenizer,
    HFTokenizer,
    Sampling,
    complete,
    generate_ids,
    load_tokenizer,
)
from trainer.models import build_model

PROMPT = list("Le café déjà vu ".encode())
FAMILIES = {
    "gpt": ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=64),
    "llama": LlamaConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=64),
    # Mixtral: its export's greedy decoding is transformers' MixtralForCausalLM's
    "moe": MoeConfig(family="moe", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=64),
}


def tiny(cfg: Any) -> Any:
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6)
    return model.eval()


def greedy(model: Any, n: int, use_cache: bool = True) -> list[int]:
    params = Sampling(max_tokens=n, temperature=0)
    return [int(t[0]) for t in generate_ids(model, PROMPT, params, use_cache=use_cache)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_with_the_kv_cache_equals_the_full_forward_and_transformers(
    family: str, tmp_path: Path
) -> None:
    import transformers

    from trainer.export import export

    model = tiny(FAMILIES[family])
    steps = 24
    cached = greedy(model, steps)
    assert len(cached) == steps and len(set(cached)) > 3, "a decoding that goes somewhere"
    assert cached == greedy(model, steps, use_cache=False)
    export(model, tmp_path / "hf", "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert out[0, len(PROMPT) :].tolist() == cached


def test_the_hf_family_decodes_with_transformers_cache(tmp_path: Path) -> None:
    import transformers

    folder = tmp_path / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config.save_pretrained(folder)
    model = tiny(HFModelConfig(family="hf", path=str(folder), seq_len=64))
    cached = greedy(model, 30)
    assert cached == greedy(model, 30, use_cache=False)
    out = model.inner.generate(
        torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, pad_token_id=0
    )
    assert out[0, len(PROMPT) :].tolist() == cached


def test_a_seed_repeats_exactly_and_another_seed_differs() -> None:
    model = tiny(FAMILIES["llama"])
    params = Sampling(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=5, n=3)

    def run(p: Sampling) -> list[list[int]]:
        return [c.token_ids for c in complete(model, ByteTokenizer(), PROMPT, p).choices]

    first = run(params)
    assert run(params) == first
    assert len({tuple(t) for t in first}) > 1, "n sequences are n draws"
    assert run(Sampling(**{**params.__dict__, "seed": 6})) != first
    # top_k 1 leaves only the argmax: sampling is greedy then, whatever the seed.
    assert run(Sampling(max_tokens=12, top_k=1, seed=9))[0] == greedy(model, 12)


@pytest.mark.parametrize(
    "params",
    [
        Sampling(max_tokens=8, temperature=1e-45, seed=1),
        Sampling(max_tokens=8, temperature=1e-6, seed=1),
        Sampling(max_tokens=8, temperature=1e-4, seed=1),
        Sampling(max_tokens=8, top_p=1e-300, seed=1),
        Sampling(max_tokens=8, temperature=1e-4, top_p=1e-300, top_k=3, seed=1),
    ],
    ids=["t1e-45", "t1e-6", "t1e-4", "top_p1e-300", "all-tiny"],
)
def test_extreme_valid_sampling_parameters_give_the_argmax_not_nan(params: Sampling) -> None:
    # Logits with wide gaps: divided by a tiny temperature they overflow unless the max is
    # subtracted first, and a top_p below float32's range once dropped every token.
    model = tiny(FAMILIES["llama"])
    got = complete(model, ByteTokenizer(), PROMPT, params).choices[0].token_ids
    assert got == greedy(model, 8)


def test_sampling_rows_with_huge_logits_stay_finite() -> None:
    from trainer.generate import sample

    logits = torch.tensor([[3e38, -3e38, 0.0], [1.0, 2.0, 1e30]])
    gen = torch.Generator().manual_seed(0)
    for params in (Sampling(temperature=1e-30), Sampling(temperature=0.5, top_p=1e-300)):
        assert sample(logits, params, gen).tolist() == [0, 2]


def test_the_byte_stream_never_splits_a_character() -> None:
    text = "é€😀 ok"
    dec = ByteTokenizer().stream()
    pieces = [dec.push(b) for b in text.encode()]
    assert "".join(pieces) + dec.flush() == text
    assert pieces[:3] == ["", "é", ""], "the first byte of é alone emits nothing"
    assert all(p in ("", *text) for p in pieces), "each piece is whole characters"
    # An unfinished character at the end becomes one U+FFFD, not bytes.
    dec = ByteTokenizer().stream()
    assert dec.push(0xE2) + dec.push(0x82) == "" and dec.flush() == "\ufffd"


def test_the_hf_tokenizer_stream_holds_back_a_partial_character(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # A byte-level BPE with no merges: "€" (3 bytes) is three tokens, as in GPT-2's.
    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer)
    text = "a€b😀"
    ids = hf.encode(text)
    assert len(ids) == 1 + 3 + 1 + 4
    dec = hf.stream()
    pieces = [dec.push(i) for i in ids]
    assert pieces == ["a", "", "", "€", "b", "", "", "", "😀"]
    assert dec.flush() == ""
    assert isinstance(load_tokenizer(tmp_path / "none"), ByteTokenizer)


def _byte_vocab() -> dict[str, int]:
    from tokenizers import pre_tokenizers

    return {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}


def test_stop_strings_cut_the_text_and_are_never_streamed() -> None:
    model = tiny(FAMILIES["gpt"])
    full = complete(model, ByteTokenizer(), PROMPT, Sampling(max_tokens=30, temperature=0))
    text = full.choices[0].text
    stop = text[6:8]
    deltas: list[str] = []
    params = Sampling(max_tokens=30, temperature=0, stop=(stop,))
    out = complete(
        model, ByteTokenizer(), PROMPT, params, on_delta=lambda i: deltas.extend(d[1] for d in i)
    )
    [choice] = out.choices
    assert choice.finish_reason == "stop" and choice.text == text[: text.find(stop)]
    assert "".join(deltas) == choice.text, "the stop string was never streamed"
    # A stop string that never completes: its held-back prefix is emitted at the end.
    out = complete(model, ByteTokenizer(), PROMPT,
                   Sampling(max_tokens=30, temperature=0, stop=(text[-1] + "\x00",)))  # fmt: skip
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
