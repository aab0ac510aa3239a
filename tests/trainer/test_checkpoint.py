"""trainer.checkpoint in one process: only complete checkpoints load, the newest wins, the last
K are kept, and a round trip restores model, optimizer and RNG exactly. Plus the small
launcher-contract helpers (env, exit.json, peak FLOPs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.checkpoint import (
    CheckpointError,
    Progress,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import ModelConfig, OptimConfig
from trainer.env import error_line, read_env, write_exit_file
from trainer.metrics import peak_flops
from trainer.model import GPT
from trainer.train import build_optimizer

CFG = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=64)


def _trained(seed: int) -> tuple[GPT, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = GPT(CFG)
    model.init_weights()
    opt = build_optimizer(model, OptimConfig())
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    opt.step()
    return model, opt


def _save(run_dir: Path, step: int, model: GPT, opt: torch.optim.Optimizer, keep: int = 2) -> Path:
    return save_checkpoint(
        run_dir,
        Progress(step, step * 100),
        model,
        opt,
        None,
        strategy="single",
        rank=0,
        world_size=1,
        keep=keep,
    )


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    model, opt = _trained(0)
    _save(tmp_path, 5, model, opt)
    root = tmp_path / "checkpoints"
    (root / "tmp-step-9").mkdir()  # a save that crashed before its rename
    (root / "step-8").mkdir()  # renamed, but the crash came before DONE
    assert latest_checkpoint(tmp_path) == root / "step-5"
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_keeps_the_newest_k(tmp_path: Path) -> None:
    model, opt = _trained(0)
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, model, opt, keep=2)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [30, 40]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-30", "step-40"]


def test_round_trip_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    model, opt = _trained(0)
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    path = _save(tmp_path, 7, model, opt)
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    other, other_opt = _trained(1)  # different weights and optimizer moments
    progress = load_checkpoint(
        path, other, other_opt, None, strategy="single", rank=0, device=torch.device("cpu")
    )
    assert progress == Progress(7, 700)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    meta = json.loads((path / "meta.json").read_text())
    assert meta["strategy"] == "single" and meta["tokens_seen"] == 700


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save alone
def test_a_sharded_checkpoint_resumes_whole(tmp_path: Path) -> None:
    """A DCP checkpoint (how FSDP and HSDP save; here written by one process) resumes a
    model that is not sharded, optimizer state included: a strategy is no part of what a
    checkpoint holds (tests/trainer/test_hsdp.py resumes across them under torchrun)."""
    model, opt = _trained(0)
    path = save_checkpoint(tmp_path, Progress(3, 300), model, opt, None, strategy="fsdp",
                           rank=0, world_size=1, keep=1)  # fmt: skip
    assert (path / "dcp").is_dir() and not (path / "model.pt").exists()
    other, other_opt = _trained(1)
    cpu = torch.device("cpu")
    got = load_checkpoint(path, other, other_opt, None, strategy="ddp", rank=0, device=cpu)
    assert got == Progress(3, 300)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def test_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    model, opt = _trained(0)
    path = _save(tmp_path, 1, model, opt)
    bigger = GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=8, vocab_size=64))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(
            path,
            bigger,
            build_optimizer(bigger, OptimConfig()),
            None,
            strategy="single",
            rank=0,
            device=torch.device("cpu"),
        )


def test_read_env() -> None:
    env = read_env(
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "TRAINQ_REDIS_URL": "redis://x/0",
            "TRAINQ_ATTEMPT": "3",
        }
    )
    assert (env.rank, env.world_size, env.distributed, env.is_main) == (1, 2, True, False)
    assert (env.redis_url, env.redis_prefix, env.attempt) == ("redis://x/0", "trainq", 3)
    alone = read_env({})
    assert (alone.rank, alone.world_size, alone.distributed, alone.redis_url) == (0, 1, False, None)
    with pytest.raises(ValueError, match="TRAINQ_ATTEMPT"):
        read_env({"TRAINQ_ATTEMPT": "two"})
    with pytest.raises(ValueError, match="RANK=2 is not in WORLD_SIZE=2"):
        read_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_first_failing_rank_writes_exit_json(tmp_path: Path) -> None:
    assert write_exit_file(tmp_path, "oom", "first", rank=1, step=3, exit_code=76)
    assert (tmp_path / "exit.json").stat().st_mode & 0o777 == 0o640  # whatever the umask
    assert not write_exit_file(tmp_path, "nan_loss", "second", rank=0, step=3, exit_code=75)
    assert json.loads((tmp_path / "exit.json").read_text()) == {
        "reason": "oom",
        "message": "first",
        "rank": 1,
        "step": 3,
        "exit_code": 76,
    }


def test_no_peak_flops_on_cpu() -> None:
    assert peak_flops(torch.device("cpu"), "bf16") is None


class _Custom(Exception):
    pass


def test_error_line_is_the_last_line_of_a_traceback() -> None:
    assert error_line(IndexError("index out of range in self")) == (
        "IndexError: index out of range in self"
    )
    assert error_line(KeyError("python")) == "KeyError: 'python'"
    assert error_line(RuntimeError()) == "RuntimeError"
    # One line: the message's first non-empty one (torch's errors go on for paragraphs).
    assert error_line(ValueError("\n  first\nsecond\n")) == "ValueError: first"
    assert error_line(_Custom("x")) == f"{__name__}._Custom: x"
    long = error_line(RuntimeError("y" * 5000))
    assert len(long) == 400 and long.startswith("RuntimeError: yyy") and long.endswith("...")
