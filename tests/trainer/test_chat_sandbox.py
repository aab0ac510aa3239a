"""trainer.chat_sandbox: a template that burns CPU or memory fails alone, within its bounds,
in a child process, and the next render is served."""

from __future__ import annotations

import time

import pytest

from trainer.chat import ChatTemplateError, render
from trainer.chat_sandbox import MAX_CHARS, render_isolated

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_renders_as_render_does() -> None:
    assert render_isolated(None, MESSAGES, True, "<s>") == render(None, MESSAGES, True, "<s>")
    tpl = "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
    assert render_isolated(tpl, MESSAGES, False, "<s>") == "<s>user:Hi"
    with pytest.raises(ChatTemplateError, match="stop"):
        render_isolated("{{ raise_exception('stop') }}", MESSAGES)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{{ (9**9)**(9**9) }}", "longer than"),  # one big-integer power: hours of CPU
        (
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            "longer than",
        ),
        ("{{ 'x' * 10**10 }}", "[Mm]emory|exhausted"),  # 10 GB
        ("{{ 'x' * (MAX + 1) }}".replace("MAX", str(MAX_CHARS)), "over"),
    ],
)
def test_a_template_that_burns_cpu_or_memory_fails_within_bounds(template: str, why: str) -> None:
    began = time.monotonic()
    with pytest.raises(ChatTemplateError, match=why):
        render_isolated(template, MESSAGES, timeout=1.0)
    assert time.monotonic() - began < 10
    assert render_isolated(None, MESSAGES) == render(None, MESSAGES)  # the next one is served
