"""The worker's chat prompt (``worker.generate._chat_prompt``): which template renders a chat
request — the request's, else the dataset tokenizer's own, else trainer.chat's ChatML — with
the tokenizer's special tokens, and a template that fails as the request's 422 naming the
field. A real Hugging Face tokenizer folder, loaded as the worker loads it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainer.chat import DEFAULT_TEMPLATE, render
from worker.generate import GenerateError, Loaded, _chat_prompt
from worker.genmessage import GenerateRequest

OWN = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _loaded(folder: Path, config: dict[str, object] | None) -> Loaded:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from trainer.generate import load_tokenizer

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Loaded(None, load_tokenizer(folder), 0, 0, 0.0)


def _request(**fields: object) -> GenerateRequest:
    return GenerateRequest(id="0" * 32, job_id="ab", kind="chat", messages=MESSAGES,
                           deadline=time.time() + 60, **fields)  # type: ignore[arg-type]  # fmt: skip


def test_the_tokenizers_own_template_with_its_special_tokens(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path / "own", {"chat_template": OWN, "bos_token": "<s>",
                                        "eos_token": {"content": "</s>"}})  # fmt: skip
    text = _chat_prompt(_request(), loaded)
    assert text == "<s>[system] Be brief.</s>[user] Hi</s>[assistant] "
    assert _chat_prompt(_request(add_generation_prompt=False), loaded).endswith("Hi</s>")
    # The request's template wins over the tokenizer's.
    mine = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    assert _chat_prompt(_request(chat_template=mine), loaded) == "BE BRIEF.HI"


def test_without_a_template_chatml(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path / "none", None)
    assert _chat_prompt(_request(), loaded) == render(DEFAULT_TEMPLATE, MESSAGES, True)


@pytest.mark.parametrize("mine", [True, False])
def test_a_failing_template_is_a_422_naming_its_field(tmp_path: Path, mine: bool) -> None:
    bad = "{{ raise_exception('only users here') }}"
    loaded = _loaded(tmp_path / "bad", None if mine else {"chat_template": bad})
    with pytest.raises(GenerateError) as err:
        _chat_prompt(_request(chat_template=bad) if mine else _request(), loaded)
    assert err.value.status == 422 and "only users here" in err.value.message
    assert err.value.loc == ["body", "chat_template" if mine else "messages"]


def test_a_template_that_renders_nothing_names_the_template(tmp_path: Path) -> None:
    """The sandbox renders a refused attribute as nothing: no "prompt" to name in a chat."""
    loaded = _loaded(tmp_path / "empty", None)
    with pytest.raises(GenerateError) as err:
        _chat_prompt(_request(chat_template="{{ ''.__class__ }}"), loaded)
    assert err.value.status == 422 and err.value.loc == ["body", "chat_template"]
