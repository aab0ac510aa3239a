"""trainer.chat renders as transformers' ``apply_chat_template`` does (the same templates, the
same text), in a sandbox, with a documented ChatML default."""

from __future__ import annotations

import pytest

from trainer.chat import DEFAULT_TEMPLATE, ChatTemplateError, render

# A Llama-2-style template: bos_token, raise_exception, whitespace control, a loop variable.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system %}"
    "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Block tags on their own lines: trim_blocks and lstrip_blocks decide the whitespace.
BLOCKY = """{% for m in messages %}
  {% if m.role == 'user' %}
U: {{ m.content | tojson }}
  {% else %}
A: {{ m.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}"""
# Answers marked for training (transformers' {% generation %}): served, the tag is ignored.
MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}"
    "{{ eos_token }}{% endgeneration %}\n{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ✓"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": 'Say "x"'},
]


def _hf_tokenizer(template: str) -> object:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=template,
    )


@pytest.mark.parametrize("template", [LLAMA2, BLOCKY, DEFAULT_TEMPLATE, MARKED])
@pytest.mark.parametrize("generation", [True, False])
def test_renders_as_transformers_apply_chat_template(template: str, generation: bool) -> None:
    tok = _hf_tokenizer(template)
    messages = MESSAGES[1:] if template == BLOCKY else MESSAGES
    expected = tok.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=False, add_generation_prompt=generation
    )
    assert render(template, messages, generation, "<s>", "</s>") == expected


def test_the_default_is_chatml() -> None:
    text = render(None, MESSAGES[:2], True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✓<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render(None, MESSAGES[:2], False).endswith("assistant\n")


def test_a_failing_or_hostile_template_is_one_line_error() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render(LLAMA2, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for %}", MESSAGES)
    # The sandbox: no reaching Python internals from a template a user sent.
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", MESSAGES)
    with pytest.raises(ChatTemplateError):  # immutable: a template cannot change its input
        render("{% set _ = messages.append(1) %}", MESSAGES)
    # What the sandbox raises beyond TemplateError is the template's failure too, not a 500.
    with pytest.raises(ChatTemplateError, match="Range too big"):  # OverflowError
        render("{% for i in range(10**9) %}x{% endfor %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="recursion"):  # RecursionError
        render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", MESSAGES)
