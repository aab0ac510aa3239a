"""Regenerate tests/trainer/golden/debug_model_losses.json, only on purpose:

    .venv/bin/python -m tests.trainer.regen_golden

A changed golden file means the debug model's numbers changed; say why in the commit.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from tests.trainer.runs import GOLDEN, REPO, golden_config, golden_run


def main() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        values = golden_run(Path(tmp), env)
    record = {
        "about": "per-step training loss of the debug model (one process, fp32, CPU); "
        "regenerate with `python -m tests.trainer.regen_golden`",
        "torch": torch.__version__,
        "config": golden_config(),
        "losses": values,
    }
    GOLDEN.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {GOLDEN}: {len(values)} losses, {values[0]:.6f} -> {values[-1]:.6f}")


if __name__ == "__main__":
    main()
