"""trainer.generate's Engine: requests decoded together give each what it gets alone
(greedy tokens equal, log-probabilities within 1e-4) for gpt, llama and a Hugging Face Qwen2;
echo's prompt log-probabilities are the full forward's log-softmax; penalties, logit_bias and
EOS act on the sampled tokens.

Tiny models drawn from a seed, weights scaled up so the next token is decided by a clear
margin (as in test_generate.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.config import HFModelConfig, LlamaConfig, ModelConfig
from trainer.generate import ByteTokenizer, Engine, Request, Sampling, complete, token_text
from trainer.models import build_model

# The longest prompt ends first: the others' padding columns are then dropped.
PROMPTS = [
    list(b"Le caf\xc3\xa9 d\xc3\xa9j\xc3\xa0 vu "),
    list(b"The quick brown fox jumps over"),
    list(b"ab"),
]


def tiny(cfg: Any) -> Any:
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6)
    return model.eval()


def qwen2(folder: Path) -> HFModelConfig:
    import transformers

    transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    ).save_pretrained(folder)  # fmt: skip
    return HFModelConfig(family="hf", path=str(folder), seq_len=64)


def model_of(family: str, tmp_path: Path) -> Any:
    if family == "gpt":
        return tiny(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=64))
    if family == "llama":
        cfg = LlamaConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=64)
        return tiny(cfg)
    return tiny(qwen2(tmp_path / "qwen2"))


def params(i: int) -> Sampling:
    # different lengths (a request leaves the batch early), n, logprobs and echo per request
    return Sampling(max_tokens=(20, 7, 14)[i], temperature=0, n=(1, 2, 1)[i],
                    logprobs=(3, None, 0)[i], echo=i == 0)  # fmt: skip


def assert_same(alone: Any, together: Any) -> None:
    assert [c.token_ids for c in together.choices] == [c.token_ids for c in alone.choices]
    assert [c.text for c in together.choices] == [c.text for c in alone.choices]
    for a, b in zip(alone.choices, together.choices, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        for ra, rb in zip(a.logprobs or (), b.logprobs or (), strict=True):
            assert ra["id"] == rb["id"] and ra["offset"] == rb["offset"]
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-4
            assert [t["id"] for t in ra["top"]] == [t["id"] for t in rb["top"]]
    if alone.prompt_logprobs is not None:
        for ra, rb in zip(alone.prompt_logprobs[1:], together.prompt_logprobs[1:], strict=True):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-4


@pytest.mark.parametrize("family", ["gpt", "llama", "hf"])
def test_requests_decoded_together_equal_each_alone(family: str, tmp_path: Path) -> None:
    model = model_of(family, tmp_path)
    tok = ByteTokenizer()
    alone = [complete(model, tok, p, params(i)) for i, p in enumerate(PROMPTS)]
    assert len({tuple(c.token_ids) for a in alone for c in a.choices}) > 2, "prompts differ"
    for joining in (False, True):
        engine = Engine(model, tok)
        reqs = [Request(p, params(i)) for i, p in enumerate(PROMPTS)]
        if not joining:  # static batching: all at once
            engine.add(reqs)
        else:  # the third joins a batch already decoding (continuous batching)
            engine.add(reqs[:2])
            for _ in range(3):
                engine.step()
            assert engine.can_join
            engine.add(reqs[2:])
        engine.run()
        assert [r.batch for r in reqs] == [3, 3, 3]
        for a, r in zip(alone, reqs, strict=True):
            assert r.error is None and r.result is not None
            assert_same(a, r.result)


@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_requests_with_the_same_prompt_share_a_prefill_and_equal_each_alone(
    family: str, tmp_path: Path
) -> None:
    """A harness sends one context's choices, or an item's repeats, together: requests with
    the same prompt are prefilled once; each still gets what it gets alone."""
    model = model_of(family, tmp_path)
    tok = ByteTokenizer()
    echo = Sampling(max_tokens=3, temperature=0, logprobs=2, echo=True)
    same = [echo, Sampling(max_tokens=1, temperature=0, logprobs=1, echo=True),
            Sampling(max_tokens=3, temperature=0, n=2), echo]  # fmt: skip
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[1], PROMPTS[2]]
    alone = [complete(model, tok, p, s) for p, s in zip(prompts, same, strict=True)]
    engine = Engine(model, tok)
    reqs = [Request(p, s) for p, s in zip(prompts, same, strict=True)]
    forwards: list[int] = []
    embed = model.inner.get_input_embeddings() if family == "hf" else model.wte
    hook = embed.register_forward_pre_hook(lambda m, a: forwards.append(int(a[0].shape[0])))
    try:
        engine.add(reqs)
    finally:
        hook.remove()
    assert forwards == [2], "two distinct prompts: one prefill row each"
    engine.run()
    for a, r in zip(alone, reqs, strict=True):
        assert r.error is None and r.result is not None
        assert_same(a, r.result)
        assert r.result.prompt_text == a.prompt_text


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_seeded_sample_in_a_batch_is_the_one_drawn_alone(family: str, tmp_path: Path) -> None:
    model = model_of(family, tmp_path)
    tok = ByteTokenizer()
    sampled = Sampling(max_tokens=12, temperature=0.8, top_p=0.95, seed=3, n=3)
    alone = complete(model, tok, PROMPTS[2], sampled)
    assert len({tuple(c.token_ids) for c in alone.choices}) > 1, "n draws"
    reqs = [Request(PROMPTS[0], params(0)), Request(PROMPTS[2], sampled)]
    engine = Engine(model, tok)
    engine.add(reqs)
    engine.run()
    assert reqs[1].result is not None and reqs[1].result.seed == 3
    assert [c.token_ids for c in reqs[1].result.choices] == [c.token_ids for c in alone.choices]


@pytest.mark.parametrize("family", ["gpt", "llama", "hf"])
def test_echo_gives_the_full_forwards_log_softmax(family: str, tmp_path: Path) -> None:
    model = model_of(family, tmp_path)
    prompt = PROMPTS[0]
    out = complete(model, ByteTokenizer(), prompt, Sampling(max_tokens=0, echo=True, logprobs=2))
    assert out.choices[0].token_ids == [] and out.completion_tokens == 0
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt])).float(), dim=-1)[0]
    records = out.prompt_logprobs
    assert records is not None and records[0] is None and len(records) == len(prompt)
    for i, rec in enumerate(records[1:], start=1):
        assert rec["id"] == prompt[i]
        assert abs(rec["logprob"] - float(full[i - 1, prompt[i]])) < 1e-4
        assert [t["id"] for t in rec["top"]] == full[i - 1].topk(2).indices.tolist()
    text = bytes(prompt).decode()
    assert out.prompt_text == text
    # offsets: each record's character offset in the prompt text; é's second byte is not
    # UTF-8 alone, written as OpenAI writes it
    assert records[3]["token"] == "c" and records[3]["offset"] == 3
    assert records[7]["token"] == "bytes:\\xa9" and records[7]["bytes"] == [0xA9]
    assert records[6]["offset"] == records[7]["offset"] == 6 and records[8]["offset"] == 7


def test_a_logit_bias_forces_a_token_and_a_penalty_changes_a_repeat() -> None:
    model = model_of("llama", Path())
    tok = ByteTokenizer()
    plain = complete(model, tok, PROMPTS[1], Sampling(max_tokens=24, temperature=0, logprobs=0))
    ids = plain.choices[0].token_ids
    forced = Sampling(max_tokens=6, temperature=0, logit_bias=((ord("z"), 100.0),), logprobs=0)
    out = complete(model, tok, PROMPTS[1], forced).choices[0]
    assert out.token_ids == [ord("z")] * 6
    # the records are of the raw logits, before the bias
    assert out.logprobs is not None and out.logprobs[0]["logprob"] < -1
    assert len(ids) > len(set(ids)), "greedy repeats a token"
    penalised = Sampling(max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    got = complete(model, tok, PROMPTS[1], penalised).choices[0].token_ids
    assert got != ids and len(set(got)) > len(set(ids))
    assert token_text("é".encode()) == "é" and token_text(b"\xe2\x82") == "bytes:\\xe2\\x82"


def test_eos_ends_a_choice_unless_ignored() -> None:
    model = model_of("gpt", Path())
    tok = ByteTokenizer()
    plain = complete(model, tok, PROMPTS[0], Sampling(max_tokens=20, temperature=0)).choices[0]
    eos = plain.token_ids[5]
    first = plain.token_ids.index(eos)
    out = complete(model, tok, PROMPTS[0], Sampling(max_tokens=20, temperature=0, eos=(eos,)))
    [c] = out.choices
    # the EOS id ends the choice's ids (as vLLM counts it), not its text
    assert c.finish_reason == "stop" and c.token_ids == plain.token_ids[: first + 1]
    assert c.text == bytes(plain.token_ids[:first]).decode(errors="replace")
    # ignore_eos: the worker passes no eos ids
    again = complete(model, tok, PROMPTS[0], Sampling(max_tokens=20, temperature=0)).choices[0]
    assert again.token_ids == plain.token_ids and again.finish_reason == "length"


def test_an_hf_tokenizer_gives_its_special_tokens_template_and_token_bytes(
    tmp_path: Path,
) -> None:
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from trainer.generate import HFTokenizer, load_tokenizer

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True),
                            AddedToken("<|endoftext|>", special=True)])  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer)
    end = hf.token_id("<|endoftext|>")
    # none declared: a well-known end-of-text special token of tokenizer.json
    assert hf.eos_ids == (end,) and hf.chat_template is None and hf.eos_token is None
    ids = hf.encode("a€")
    assert [hf.piece(i) for i in ids] == [b"a", b"\xe2", b"\x82", b"\xac"]
    assert hf.token_str(ids[0]) == "a" and token_text(hf.piece(ids[1])) == "bytes:\\xe2"
    assert hf.piece(end) == b"<|endoftext|>"

    template = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>"}, "bos_token": None, "chat_template": template,
    }))  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    hf = load_tokenizer(tmp_path)
    assert set(hf.eos_ids) == {end, hf.token_id("<|im_end|>")}
    assert hf.eos_token == "<|im_end|>" and hf.bos_token is None
    assert hf.chat_template == template
