"""Regenerate tests/trainer/golden/{debug_model,llama_debug}_losses.json, only on purpose:

    .venv/bin/python -m tests.trainer.regen_golden

A changed golden file means the debug model's numbers changed; say why in the commit.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from tests.trainer.runs import GOLDEN, LLAMA_GOLDEN, REPO, golden_config, golden_run
from tests.trainer.test_llama import golden_llama_config


def main() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for path, what, cfg in (
        (GOLDEN, "the debug model", golden_config()),
        (LLAMA_GOLDEN, "the llama debug model", golden_llama_config()),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            values = golden_run(Path(tmp), env, cfg)
        record = {
            "about": f"per-step training loss of {what} (one process, fp32, CPU); "
            "regenerate with `python -m tests.trainer.regen_golden`",
            "torch": torch.__version__,
            "config": cfg,
            "losses": values,
        }
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}: {len(values)} losses, {values[0]:.6f} -> {values[-1]:.6f}")


if __name__ == "__main__":
    main()
