"""How runs end badly: a diverging loss, an invalid config, unusable data, a crash; and how
they report (one line, an exit code, exit.json). Also bf16 on CPU and metrics over a real
Redis."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import redis
import torch

from tests.trainer import runs
from trainer.__main__ import main as trainer_main
from trainer.data import TokenDataset, check_vocab, write_shard
from trainer.events import Event, ExitCode, Keys
from trainer.prepare import prepare


def _exit_info(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "exit.json").read_text())


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        env=env,
        cwd=runs.REPO,
        text=True,
        capture_output=True,
        timeout=60,
    )


def test_nan_loss_stops_every_rank(
    data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # A real divergence: decoupled weight decay at lr 10 multiplies the weights by
    # 1 - lr * wd = -99 each step, so they overflow fp32 within a few steps.
    cfg = runs.config(
        optim={"lr": 10.0, "weight_decay": 10.0, "grad_clip": 0.0, "warmup_steps": 0},
        eval={"every": 0},
        checkpoint={"every": 0},
    )
    code, out = runs.run(cfg, tmp_path / "run", data_root, subprocess_env, timeout=90)
    assert code != 0
    lines = [line for line in out.splitlines() if "trainer: nan_loss:" in line]
    assert len(lines) == 1, out  # rank 0 reports for both
    assert re.search(r"loss is (nan|inf) at step \d+", lines[0])
    # The ranks exited with NAN_LOSS (torchrun's failure summary; a rank that torchrun
    # stopped first, once the other had failed, shows as a signal instead).
    assert re.search(rf"exitcode\s*:\s*{int(ExitCode.NAN_LOSS)} \(pid", out), out
    info = _exit_info(tmp_path / "run")
    assert info["reason"] == "nan_loss" and info["exit_code"] == ExitCode.NAN_LOSS
    assert info["rank"] == 0 and isinstance(info["step"], int)
    assert not (tmp_path / "run" / "checkpoints").exists()  # a diverged state is not saved


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model": {"n_head": 3}}, "d_model (32) must be divisible by n_head (3)"),
        ({"optim": {"lrr": 0.1}}, "optim.lrr"),
        ({"steps": 0}, "steps"),
        ({"strategy": "zero3"}, "strategy"),
    ],
)
def test_invalid_config_is_one_line_spec_error(
    overrides: dict[str, object],
    field: str,
    data_root: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(runs.config(**overrides)))
    args = [
        "--config",
        str(cfg_path),
        "--run-dir",
        str(tmp_path / "run"),
        "--data-root",
        str(data_root),
    ]
    proc = _cli(args, subprocess_env)
    assert proc.returncode == ExitCode.SPEC_ERROR, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert field in proc.stderr and proc.stderr.startswith("trainer: error: invalid config")
    assert _exit_info(tmp_path / "run")["reason"] == "spec_error"


def test_invalid_config_under_torchrun_fails_every_rank_before_the_process_group(
    data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    code, out = runs.run(
        runs.config(batch={"micro_batch_size": 0}), tmp_path / "run", data_root, subprocess_env
    )
    assert code != 0
    assert out.count("trainer: error: invalid config: batch.micro_batch_size") == 1, out
    assert re.search(rf"exitcode\s*:\s*{int(ExitCode.SPEC_ERROR)} \(pid", out), out
    # torchrun prints its own ChildFailedError traceback; none comes from the ranks.
    assert f'File "{runs.REPO / "trainer"}' not in out


def _main(cfg: dict[str, object], tmp_path: Path, data_root: Path) -> int:
    """The CLI in this process: these failures all happen before any process group."""
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(cfg))
    args = ["--config", str(cfg_path), "--run-dir", str(tmp_path / "run")]
    return trainer_main([*args, "--data-root", str(data_root)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is allowed where CUDA is")
def test_fp16_on_cpu_is_a_spec_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(runs.config(precision="fp16"), tmp_path, data_root) == ExitCode.SPEC_ERROR
    assert capsys.readouterr().err == (
        "trainer: error: precision: fp16 needs CUDA (GradScaler); use bf16 or fp32 on CPU\n"
    )
    assert _exit_info(tmp_path / "run")["reason"] == "spec_error"


def test_fp16_with_fsdp_is_a_spec_error(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = runs.config(strategy="fsdp", precision="fp16")
    assert _main(cfg, tmp_path, data_root) == ExitCode.SPEC_ERROR
    assert "fp16 works with strategy ddp only" in capsys.readouterr().err


def _bad_magic(folder: Path) -> str:
    runs.write_corpus(folder.parent)
    shard = folder / "train_000.bin"
    data = bytearray(shard.read_bytes())
    data[0:4] = (12345).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    return f"shard {folder.name}/{shard.name} is not an llm.c token shard"


def _no_val(folder: Path) -> str:
    write_shard(folder / "train_000.bin", np.array([1, 2, 3] * 100))
    return f"data folder {folder.name} has no val shards"


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda folder: f"data folder {folder.name} does not exist", "missing"),
        (_bad_magic, "tiny"),
        (_no_val, "noval"),
    ],
    ids=["missing-folder", "wrong-magic", "no-val-split"],
)
def test_data_errors_are_one_line(
    make: Callable[[Path], str], path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    expected = make(root / path)
    assert _main(runs.config(data={"path": path}), tmp_path, root) == ExitCode.DATA_ERROR
    err = capsys.readouterr().err
    assert err.startswith("trainer: error: ") and err.count("\n") == 1, err
    assert expected in err
    info = _exit_info(tmp_path / "run")
    assert info["exit_code"] == ExitCode.DATA_ERROR and expected in str(info["message"])
    # named as the spec names it: no server path, no byte of the file (issue 22)
    assert str(tmp_path) not in err and "12345" not in err


def _prepared(root: Path, name: str) -> Path:
    """A byte-level dataset made by trainer.prepare: vocab 256 in its meta.json."""
    text = root / f"{name}.txt"
    text.write_text(" ".join(runs.WORDS) * 200)
    prepare([text], root / name)
    return root / name


def _prepared_for_a_bigger_model(root: Path) -> tuple[str, int, str]:
    _prepared(root, "bytes")
    # Its bytes are all below 128, so only meta.json can tell that it needs 256.
    return (
        "bytes",
        200,
        (
            "dataset 'bytes' has vocab 256 (max token id 255) but model.vocab_size is 200; "
            "set model.vocab_size to at least 256"
        ),
    )


def _llmc_shards_without_meta(root: Path) -> tuple[str, int, str]:
    write_shard(root / "raw" / "train_000.bin", np.arange(5000) % 301)
    write_shard(root / "raw" / "val_000.bin", np.arange(500) % 100)
    return (
        "raw",
        256,
        (
            "dataset 'raw' has max token id 300 but model.vocab_size is 256; "
            "set model.vocab_size to at least 301"
        ),
    )


def _shards_rewritten_under_a_stale_meta(root: Path) -> tuple[str, int, str]:
    folder = _prepared(root, "stale")
    for shard in folder.glob("train*.bin"):
        shard.unlink()
    write_shard(folder / "train_000000.bin", np.arange(4000) % 290)  # another count
    return (
        "stale",
        256,
        (
            "dataset 'stale' has max token id 289 but model.vocab_size is 256; "
            "set model.vocab_size to at least 290"
        ),
    )


@pytest.mark.parametrize(
    "make",
    [_prepared_for_a_bigger_model, _llmc_shards_without_meta, _shards_rewritten_under_a_stale_meta],
    ids=["meta-json", "no-meta-json", "stale-meta-json"],
)
def test_token_ids_past_the_model_vocab_are_a_spec_error_before_any_process_group(
    make: Callable[[Path], tuple[str, int, str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not an IndexError at the first forward pass, once every rank has built its model: the
    same one line as any data error, from meta.json when it describes the shards, else from
    the shards' largest token id."""
    root = tmp_path / "data"
    root.mkdir()
    path, vocab, expected = make(root)
    cfg = runs.config(data={"path": path}, model={"vocab_size": vocab})
    assert _main(cfg, tmp_path, root) == ExitCode.DATA_ERROR
    assert capsys.readouterr().err == f"trainer: error: {expected}\n"
    info = _exit_info(tmp_path / "run")
    assert (info["reason"], info["message"], info["rank"]) == ("spec_error", expected, 0)
    splits = [TokenDataset(root / path, split, 32) for split in ("train", "val")]
    check_vocab(path, 512, splits)  # a model that covers them: no error


def test_an_uncaught_exception_is_recorded_by_the_rank_that_raised_it(
    data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Rank 1 alone fails (its RNG file in the checkpoint is not one): exit.json names its
    exception in one line, not rank 0's connection error that follows once rank 1 is gone."""
    from trainer.checkpoint import Progress, save_checkpoint
    from trainer.config import TrainConfig
    from trainer.model import GPT
    from trainer.train import build_optimizer

    cfg = runs.config(steps=8, eval={"every": 0}, checkpoint={"every": 0, "keep": 1})
    model_cfg = TrainConfig.model_validate(cfg)
    gpt = GPT(model_cfg.model)
    run_dir = tmp_path / "run"
    ckpt = save_checkpoint(run_dir, Progress(step=4, tokens_seen=0), gpt,
                           build_optimizer(gpt, model_cfg.optim), None, strategy="ddp", rank=0,
                           world_size=2, keep=1)  # fmt: skip
    torch.save({}, ckpt / "rng-rank1.pt")
    code, out = runs.run(cfg, run_dir, data_root, subprocess_env)
    assert code != 0
    assert _exit_info(run_dir) == {
        "reason": "exit_code",
        "message": "KeyError: 'python'",
        "rank": 1,
        "step": None,
        "exit_code": 1,
    }, out
    assert "KeyError: 'python'" in out  # the traceback is still printed, in the rank's log


def test_a_known_failure_inside_the_run_is_not_recorded_as_a_crash(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint of another model is found while the run is set up, inside the part
    where any other exception is recorded as a crash: it stays a one-line spec_error."""
    from trainer.checkpoint import Progress, save_checkpoint
    from trainer.config import TrainConfig
    from trainer.model import GPT
    from trainer.train import build_optimizer

    cfg = runs.config(eval={"every": 0})
    model_cfg = TrainConfig.model_validate(runs.config(model={"n_layer": 1}))
    gpt = GPT(model_cfg.model)
    save_checkpoint(tmp_path / "run", Progress(step=4, tokens_seen=0), gpt,
                    build_optimizer(gpt, model_cfg.optim), None, strategy="ddp", rank=0,
                    world_size=2, keep=1)  # fmt: skip
    assert _main(cfg, tmp_path, data_root) == ExitCode.SPEC_ERROR
    err = capsys.readouterr().err
    assert err.startswith("trainer: error: checkpoint ") and err.count("\n") == 1, err
    info = _exit_info(tmp_path / "run")
    assert info["reason"] == "spec_error" and "does not fit this model" in str(info["message"])


def test_bf16_fsdp_on_cpu_publishes_metrics_to_redis(
    data_root: Path, tmp_path: Path, subprocess_env: dict[str, str], redis_url: str
) -> None:
    prefix = f"tq-{uuid.uuid4().hex[:8]}"
    env = dict(
        subprocess_env,
        TRAINQ_REDIS_URL=redis_url,
        TRAINQ_REDIS_PREFIX=prefix,
        TRAINQ_JOB_ID="job-7",
        TRAINQ_ATTEMPT="2",
    )
    cfg = runs.config(
        strategy="fsdp", precision="bf16", steps=8, eval={"every": 4}, checkpoint={"every": 0}
    )
    code, out = runs.run(cfg, tmp_path / "run", data_root, env)
    assert code == 0, out
    assert "bf16" in out
    local = runs.metrics(tmp_path / "run")
    assert [m["step"] for m in local] == list(range(1, 9))
    assert local[-1]["loss"] < local[0]["loss"]

    client = redis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    try:
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.events))
        per_job = cast(list[object], client.xrange(keys.job("job-7")))
    finally:
        client.close()
    events = [Event.from_fields(fields) for _, fields in entries]
    # Rank 0 alone publishes: one event per step, numbered 1..8, same numbers as the file,
    # then the final checkpoint's (checkpoint.written, for webhooks), numbered 9.
    assert [(e.kind, e.source, e.job_id, e.attempt) for e in events] == [
        ("metric", "trainer", "job-7", 2)
    ] * 8 + [("checkpoint", "trainer", "job-7", 2)]
    assert [e.seq for e in events] == list(range(1, 10))
    assert [e.data for e in events[:8]] == local
    assert events[8].data["step"] == 8 and events[8].data["checkpoint"] == "step-8"
    assert [e.data["step"] for e in events if "val_loss" in e.data] == [4, 8]
    assert len(per_job) == 9
