"""A worker on a host without the ``hf`` extra says so once, at start, naming the install,
rather than leaving each finished job without its Hugging Face folder unexplained."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests.worker.conftest import WorkerProc, wait_for
from trainer.publish import start_warning


def test_the_warning_names_what_is_missing_and_the_extra() -> None:
    assert start_warning(lambda name: object()) is None  # everything installed
    line = start_warning(lambda name: None if name == "transformers" else object())
    assert line is not None and line.startswith("transformers not installed on this worker")
    assert "pip install 'trainq[hf]'" in line and "\n" not in line
    both = start_warning(lambda name: None)
    assert both is not None and both.startswith("safetensors and transformers not installed")


def test_a_worker_without_transformers_warns_once_at_start(
    start_worker: Callable[..., WorkerProc], subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    # The package cannot be uninstalled for a test: this interpreter is told it is absent
    # (what importlib's find_spec then answers), before the worker imports anything.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    path = os.pathsep.join([str(hide), subprocess_env["PYTHONPATH"]])
    w = start_worker("nohf", env={"PYTHONPATH": path})
    wait_for(lambda: "ready." in w.log(), 30, "the worker's ready line")
    warned = [line for line in w.log().splitlines() if "trainq[hf]" in line]
    assert len(warned) == 1, w.log()
    assert "WARNING" in warned[0] and "transformers not installed on this worker" in warned[0]
