"""CUDA only (skipped without a GPU): bf16 autocast and fp16 with GradScaler train on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer import runs


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cuda(
    precision: str, data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    cfg = runs.config(precision=precision, batch={"micro_batch_size": 8}, checkpoint={"every": 10})
    code, out = runs.run(cfg, tmp_path / "run", data_root, subprocess_env, nproc=1)
    assert code == 0, out
    records = runs.metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert all(r["mem_peak_bytes"] > 0 for r in records)
    if precision == "fp16":  # the GradScaler's state travels with the checkpoint
        assert (tmp_path / "run" / "checkpoints" / "step-20" / "scaler.pt").is_file()
