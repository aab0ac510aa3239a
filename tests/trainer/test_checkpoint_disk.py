"""A checkpoint that the disk cannot hold: refused before it is written, or, when a write
fails for want of room (ENOSPC), its temp folder removed; either way DiskFull."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.smallfs import small_fs
from trainer.checkpoint import DiskFull, Progress, checkpoint_bytes, save_checkpoint


def _save(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    return save_checkpoint(run_dir, Progress(step=3, tokens_seen=0), model, optimizer, None,
                           strategy="ddp", rank=0, world_size=1, keep=2)  # fmt: skip


def _stepped(model: nn.Module, **adam: bool) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), **adam)
    model(torch.ones(1, model.in_features)).sum().backward()
    optimizer.step()
    return optimizer


def test_a_checkpoint_without_room_is_refused_before_any_file(tmp_path: Path) -> None:
    model = nn.Linear(1024, 1024)  # 4 MiB of weights: about 12 MiB with AdamW's moments
    optimizer = _stepped(model)
    with small_fs(tmp_path / "runs", 8) as runs:
        with pytest.raises(DiskFull, match="no room for checkpoint step 3"):
            _save(runs / "job", model, optimizer)
        assert list((runs / "job" / "checkpoints").iterdir()) == []


def test_a_write_that_runs_out_of_room_leaves_no_temp_folder(tmp_path: Path) -> None:
    # AMSGrad keeps a third moment the estimate does not count (16 MiB here): the check
    # passes and torch.save meets ENOSPC halfway.
    model = nn.Linear(2048, 2048)
    optimizer = _stepped(model, amsgrad=True)
    need = checkpoint_bytes(model, 1)
    with small_fs(tmp_path / "runs", need // 2**20 + 8) as runs:
        with pytest.raises(DiskFull, match="no space left for checkpoint step 3") as err:
            _save(runs / "job", model, optimizer)
        assert "partial files were removed" in str(err.value)
        assert list((runs / "job" / "checkpoints").iterdir()) == []
        # The room is back: a smaller checkpoint fits now.
        small = nn.Linear(64, 64)
        assert (_save(runs / "job", small, _stepped(small)) / "DONE").is_file()
