"""``--set`` on a spec file: a key that names one of several alternatives (a dataset instead
of a data path) replaces the other, as the upload's own hint tells users to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.cli.specfile import apply_override
from tests.cli.conftest import CliSystem, Run, one_line

CORPUS = "A newcomer trains on what was uploaded, not on the demo folder.\n" * 200


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


def test_set_dataset_on_a_spec_with_a_path_trains_on_the_dataset(
    cli_system: CliSystem, trainq: Run, tmp_path: Path
) -> None:
    url = cli_system.api.url
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    up = trainq("data", "upload", str(corpus), "--name", "newcomer", "--wait", url=url)
    assert up.code == 0, up.err
    hint = next(w for w in up.out.split() if w.startswith("train.data.dataset="))

    spec = cli_system.spec("on-upload")  # data: {path: demo}, as the examples have
    assert "path: demo" in spec.read_text()
    done = trainq("submit", str(spec), "--wait", "--set", hint, url=url, timeout=240)
    assert done.code == 0, (done.out, done.err)
    job_id = done.out.split()[1]
    shown = trainq("status", job_id, "--json", url=url)
    job = json.loads(shown.out)
    folder = json.loads(trainq("data", "show", "newcomer", "--json", url=url).out)["path"]
    # Stored: the dataset, its folder frozen as the path; never the spec file's "demo".
    data = job["train"]["data"]
    assert data["dataset"] == "newcomer" and data["path"] == folder != "demo", data

    # The other way: a path over a spec that names a dataset.
    back = trainq("plan", str(spec), "--set", hint, "--set", "train.data.path=demo", url=url)
    assert back.code == 0, back.err
    # Both in the file (the user wrote both): the API still refuses, naming the field.
    both = tmp_path / "both.yaml"
    both.write_text(spec.read_text().replace("path: demo", "path: demo\n    dataset: newcomer"))
    refused = trainq("submit", str(both), url=url)
    assert refused.code == 6 and "not both" in one_line(refused.err), refused
    assert trainq("data", "rm", "newcomer", url=url).code == 0
