"""Real torchrun runs (CPU, gloo): one process, DDP and FSDP2 agree, the loss falls, the golden
losses hold, gradient accumulation matches a bigger batch, and the metrics are complete."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer import runs


def _series(run_dir: Path, n: int = 20) -> list[float]:
    got = runs.losses(run_dir)
    assert sorted(got) == list(range(1, n + 1)), f"steps logged: {sorted(got)}"
    return [got[s] for s in range(1, n + 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_and_loss_falls(strategy: str, ddp_run: Path, fsdp_run: Path) -> None:
    losses = _series(ddp_run if strategy == "ddp" else fsdp_run)
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)  # uniform over bytes at init
    assert max(losses[-3:]) < losses[0] - 2.0, losses


def test_single_ddp_fsdp_same_losses(single_run: Path, ddp_run: Path, fsdp_run: Path) -> None:
    # 1 process x micro batch 8 sees the same 8 samples per step as 2 DDP ranks x 4 and as
    # 2 FSDP ranks x 2 micro-steps x 2; a gradient reduction that sums instead of averages,
    # double-counts, or syncs a half-accumulated gradient shows up from step 2 on.
    single, ddp, fsdp = _series(single_run), _series(ddp_run), _series(fsdp_run)
    assert ddp[:5] == pytest.approx(single[:5], rel=1e-5, abs=0)
    assert fsdp[:5] == pytest.approx(single[:5], rel=1e-5, abs=0)
    # Later steps drift only by float reassociation.
    assert ddp == pytest.approx(single, rel=1e-4, abs=0)
    assert fsdp == pytest.approx(single, rel=1e-4, abs=0)


def test_golden_losses(single_run: Path) -> None:
    golden = json.loads(runs.GOLDEN.read_text())
    assert golden["config"] == runs.golden_config(), (
        "the golden config changed; regenerate with `python -m tests.trainer.regen_golden`"
    )
    assert _series(single_run) == pytest.approx(golden["losses"], abs=1e-4, rel=0), (
        "per-step losses drifted from tests/trainer/golden/debug_model_losses.json; if the "
        "change is intended, regenerate with `python -m tests.trainer.regen_golden`"
    )


def test_ddp_grad_accumulation_matches_bigger_batch(
    single_run: Path, data_root: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # 2 ranks x 2 micro-steps x 2 samples: the single run's 8 samples per step, the gradient
    # all-reduced once per step (no_sync on micro-step 0). The FSDP reference run
    # accumulates the same way (set_requires_gradient_sync), see the test above.
    cfg = runs.config(
        batch={"micro_batch_size": 2, "grad_accum_steps": 2},
        eval={"every": 0},
        checkpoint={"every": 0},
    )
    code, out = runs.run(cfg, tmp_path / "accum", data_root, subprocess_env)
    assert code == 0, out
    assert _series(tmp_path / "accum")[:5] == pytest.approx(
        _series(single_run)[:5], rel=1e-5, abs=0
    )


def test_unreachable_redis_changes_nothing(single_run: Path) -> None:
    # single_run published to a closed port: it still logged every step and finished.
    assert [m["step"] for m in runs.metrics(single_run)] == list(range(1, 21))
    assert (single_run / "checkpoints" / "step-20" / "DONE").is_file()


def test_metrics_records(ddp_run: Path) -> None:
    records = runs.metrics(ddp_run)
    assert [r["step"] for r in records] == list(range(1, 21))
    keys = {
        "step",
        "steps",
        "time",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "step_time_s",
        "tflops",
        "mfu",
        "mem_peak_bytes",
        "data_wait_frac",
    }
    for r in records:
        assert keys <= set(r), set(r) ^ keys
        assert r["steps"] == 20
        assert r["tokens_per_s"] > 0
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["tflops"] > 0 and r["mfu"] is None  # no peak FLOPs for a CPU
        assert r["mem_peak_bytes"] > 10 * 2**20  # RSS of a process that imported torch
        assert 0 <= r["data_wait_frac"] < 1
        assert r["grad_norm"] > 0
    # Eval at the eval steps only, and the lr warms up, then decays.
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    assert records[-1]["val_loss"] < records[9]["val_loss"] < math.log(256)
    lrs = [r["lr"] for r in records]
    assert lrs[0] < lrs[1] == pytest.approx(1e-2) and lrs[-1] < lrs[5]
    assert lrs[-1] >= 0.1 * 1e-2  # min_lr_ratio floor


def test_checkpoints_written_and_kept(ddp_run: Path) -> None:
    ckpts = sorted(p.name for p in (ddp_run / "checkpoints").iterdir())
    assert ckpts == ["step-10", "step-20"]
    for name in ckpts:
        folder = ddp_run / "checkpoints" / name
        assert (folder / "DONE").is_file()
        assert {p.name for p in folder.iterdir()} >= {
            "meta.json",
            "model.pt",
            "rng-rank0.pt",
            "rng-rank1.pt",
        }
    meta = json.loads((ddp_run / "checkpoints" / "step-20" / "meta.json").read_text())
    assert meta["step"] == 20 and meta["tokens_seen"] == 20 * 8 * 32
    assert not (ddp_run / "exit.json").exists()


def test_fsdp_checkpoint_is_sharded(fsdp_run: Path) -> None:
    folder = fsdp_run / "checkpoints" / "step-20"
    assert (folder / "DONE").is_file()
    assert sorted(p.name for p in (folder / "dcp").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (folder / "model.pt").exists()


def test_run_folders_are_group_readable_at_most(
    single_run: Path, ddp_run: Path, fsdp_run: Path
) -> None:
    """Started with umask 0, the runs still write folders 0750 and files 0640: checkpoints
    (renamed from their temporary folder; FSDP's DCP shards), metrics.jsonl, TensorBoard."""
    for run_dir in (single_run, ddp_run, fsdp_run):
        found = runs.modes(run_dir)
        assert {"metrics.jsonl", "checkpoints/step-20/DONE", "tb/"} <= set(found), found
        assert any(p.startswith("tb/events.") for p in found), found
        assert runs.wrong_modes(run_dir) == {}, run_dir
    assert "checkpoints/step-20/dcp/__1_0.distcp" in runs.modes(fsdp_run)
