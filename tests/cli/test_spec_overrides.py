"""``--set`` on a spec file: a key that names one of several alternatives (a dataset instead
of a data path) replaces the other, as the upload's own hint tells users to do. Training on
it through the running system is tests/cli/test_client_commands.py's (that module's system)."""

from __future__ import annotations

from typing import Any

import pytest

from service.cli.specfile import apply_override


@pytest.mark.parametrize(
    "before, assignment, after",
    [
        ({"data": {"path": "demo"}}, "train.data.dataset=fox", {"data": {"dataset": "fox"}}),
        ({"data": {"dataset": "fox"}}, "train.data.path=mine", {"data": {"path": "mine"}}),
        (
            {"init": {"job": "ab12", "step": 4}},
            "train.init.path=hf/gpt2",
            {"init": {"path": "hf/gpt2"}},
        ),
        ({"init": {"path": "hf/gpt2"}}, "train.init.job=ab12", {"init": {"job": "ab12"}}),
        # Unsetting one keeps the other; a key with no alternative touches nothing else.
        (
            {"data": {"path": "demo"}},
            "train.data.dataset=null",
            {"data": {"path": "demo", "dataset": None}},
        ),
        ({"data": {"path": "demo"}}, "train.steps=5", {"data": {"path": "demo"}, "steps": 5}),
    ],
)
def test_setting_one_alternative_drops_the_other(
    before: dict[str, Any], assignment: str, after: dict[str, Any]
) -> None:
    spec: dict[str, Any] = {"name": "x", "train": before}
    apply_override(spec, assignment)
    assert spec == {"name": "x", "train": after}
