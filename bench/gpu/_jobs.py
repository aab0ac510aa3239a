"""bench/gpu/run.py's parts: trainq's own trainer launched under torchrun with a config, its
metrics read back, and the rows' configs at GPU size and at the dry run's tiny CPU size."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class JobFailed(Exception):
    """A launch that exited non-zero or ran out of time; the message ends with its log's tail."""


@dataclass(frozen=True)
class Size:
    """The models of the rows: GPU size, or the dry run's tiny one (CPU, gloo, fp32)."""

    dry: bool

    def llama(self, d: int, layers: int, heads: int, seq: int) -> dict[str, Any]:
        if self.dry:
            d, layers, heads, seq = 32, 2, 2, 32
        return {"family": "llama", "n_layer": layers, "n_head": heads, "d_model": d,
                "seq_len": seq, "vocab_size": 256}  # fmt: skip

    def moe(self) -> dict[str, Any]:
        """A small sparse llama (the moe family's fields: the llama's plus experts)."""
        base = self.llama(512, 8, 8, 1024)
        return {**base, "family": "moe", "n_experts": 4 if self.dry else 8, "top_k": 2}

    @property
    def precision(self) -> str:
        return "fp32" if self.dry else "bf16"

    @property
    def steps(self) -> int:
        return 3 if self.dry else 25

    def micro(self, gpu: int) -> int:
        return 2 if self.dry else gpu


def config(
    size: Size, model: dict[str, Any], *, strategy: str, micro: int, steps: int | None = None,
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A trainer config: eval and periodic checkpoints off (one checkpoint at the end)."""
    return {
        "strategy": strategy,
        "precision": size.precision,
        "steps": steps or size.steps,
        "seed": 1,
        "model": model,
        "data": {"path": "demo"},
        "batch": {"micro_batch_size": micro, "grad_accum_steps": 1},
        "optim": {"lr": 3e-4, "warmup_steps": 2},
        "eval": {"every": 0},
        "checkpoint": {"every": 0, "keep": 1, "hf": "none"},
        "log_every": 1,
        **extra,
    }


def run_job(
    name: str, cfg: dict[str, Any], work: Path, data_root: Path, nproc: int, timeout: float,
    env: dict[str, str],
) -> tuple[Path, list[dict[str, Any]]]:  # fmt: skip
    """``torchrun --standalone --nproc-per-node N -m trainer --config ...``: the run folder
    and its metrics.jsonl records; JobFailed with the log's tail if it fails."""
    run_dir = work / name
    cfg_path = work / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    log = work / f"{name}.log"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "trainer", "--config", str(cfg_path),
            "--run-dir", str(run_dir), "--data-root", str(data_root)]  # fmt: skip
    with log.open("w") as out:
        try:
            done = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=max(1.0, timeout))  # fmt: skip
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        why = f"timed out after {timeout:.0f}s" if code is None else f"exit {code}"
        raise JobFailed(f"{name}: {why}\n{tail}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return run_dir, [json.loads(line) for line in lines if line.strip()]


def steady(records: list[dict[str, Any]], key: str, skip: int) -> float | None:
    """The median of ``key`` over the steps after the first ``skip`` (compile, warm-up)."""
    values = [r[key] for r in records[skip:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def losses(records: list[dict[str, Any]]) -> list[float]:
    return [float(r["loss"]) for r in records]


def moe_known() -> str | None:
    """None when ``family: moe`` is a family trainer.config knows; else why not."""
    from trainer.config import ConfigError, load_config

    try:
        load_config({"model": Size(dry=True).moe()})
    except ConfigError as exc:
        if "moe" in str(exc) and "tag" in str(exc):
            return "family moe is not known to trainer.config (the moe branch is not merged)"
    return None


class Clock:
    """The script's time budget: each row gets what is left of it."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()
