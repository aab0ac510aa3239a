"""A spec that needs the ``hf`` extra, run by a trainer on a worker without it, fails as a
spec_error whose message names the extra (``trainq[hf]``), not as a crash with a traceback.

"Without it" is made at the outside edge, the interpreter's import system: the trainer runs
as it does on a worker (``python -m trainer``'s own ``__main__``, argv, environment), in a
fresh process whose ``sys.modules`` holds ``None`` for the blocked packages, which makes
every ``import`` of them raise ImportError exactly as an absent package does. Nothing of
ours is replaced; only the third-party packages vanish. (Uninstalling them from the shared
venv instead would break every other test running beside this one.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.trainer import runs
from trainer.events import ExitCode

EXTRA = "trainq[hf]"
# A trainer process on a host where the packages are not installed.
WITHOUT = (
    "import runpy, sys; sys.modules.update(dict.fromkeys(sys.argv.pop(1).split(','))); "
    "runpy.run_module('trainer', run_name='__main__', alter_sys=True)"
)


def _run_without(
    packages: list[str], cfg: dict[str, Any], tmp: Path, data_root: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    run_dir = tmp / "run"
    cfg_path = tmp / "run.json"
    cfg_path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-c", WITHOUT, ",".join(packages)]
    argv += ["--config", str(cfg_path), "--run-dir", str(run_dir), "--data-root", str(data_root)]
    proc = subprocess.run(
        argv, env=env, cwd=runs.REPO, text=True, capture_output=True, timeout=120, check=False
    )
    exit_file = run_dir / "exit.json"
    assert exit_file.is_file(), proc.stderr
    return proc, json.loads(exit_file.read_text())


def _assert_spec_error(proc: subprocess.CompletedProcess[str], record: dict[str, Any]) -> None:
    assert proc.returncode == ExitCode.SPEC_ERROR, proc.stderr
    assert record["reason"] == "spec_error", record
    assert EXTRA in record["message"], record
    assert "Traceback" not in proc.stderr
    assert f"trainer: error: {record['message']}" in proc.stderr


def test_family_hf_without_transformers_is_a_spec_error_naming_the_extra(
    tmp_path: Path, data_root: Path, subprocess_env: dict[str, str]
) -> None:
    folder = data_root / "models" / "extra-qwen"
    folder.mkdir(parents=True, exist_ok=True)  # all the trainer reads before the model
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 256}))
    cfg = runs.config(steps=2, eval={"every": 0}, checkpoint={"every": 0})
    cfg["model"] = {"family": "hf", "path": "models/extra-qwen", "seq_len": 32}
    proc, record = _run_without(["transformers"], cfg, tmp_path, data_root, subprocess_env)
    _assert_spec_error(proc, record)
    assert "model.family hf needs transformers" in record["message"]


def test_init_from_a_hugging_face_folder_without_the_extra_is_a_spec_error(
    tmp_path: Path, data_root: Path, subprocess_env: dict[str, str]
) -> None:
    folder = data_root / "models" / "extra-llama"
    folder.mkdir(parents=True, exist_ok=True)  # the trainer stops before it reads the folder
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    model = {"family": "llama", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32}
    cfg = runs.config(model=model, steps=2, eval={"every": 0}, checkpoint={"every": 0})
    cfg["init"] = {"path": "models/extra-llama"}
    proc, record = _run_without(["safetensors"], cfg, tmp_path, data_root, subprocess_env)
    _assert_spec_error(proc, record)
    assert "init.path needs safetensors" in record["message"]
