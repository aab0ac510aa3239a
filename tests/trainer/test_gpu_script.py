"""bench/gpu/run.py, the script for the day a GPU is lent: without CUDA it says so and exits 0;
``--dry`` runs every row's code path (trainq's trainer under torchrun, the DDP vs FSDP2
comparison, the generation pair against transformers) at tiny size on the CPU. And the
peak-FLOPs table its MFU column divides by names the Hopper parts right."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.trainer import runs
from trainer.metrics import peak_flops_of

SCRIPT = runs.REPO / "bench" / "gpu" / "run.py"


def _script(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=runs.REPO, env=env, text=True,
        capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_without_cuda_it_says_so_in_one_line(subprocess_env: dict[str, str]) -> None:
    done = _script(env={**subprocess_env, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA device here" in done.stdout, done.stdout


def test_dry_runs_every_row_on_the_cpu(subprocess_env: dict[str, str]) -> None:
    env = {**subprocess_env, "CUDA_VISIBLE_DEVICES": ""}
    done = _script("--dry", env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.splitlines()
    assert table[0].startswith("device: CPU (--dry"), table
    rows = {line.split("  ")[0].strip(): line for line in table[3:]}
    assert list(rows) == [
        "llama-350m fsdp2 bf16 compile",
        "llama-1b fsdp2 bf16 compile",
        "moe fsdp2 bf16 compile",
        "ddp vs fsdp2 losses",
        "fp16 ddp + GradScaler",
        "fsdp2 cpu offload vs none",
        "generation vs transformers",
    ], table
    assert "FAILED" not in done.stdout and "budget is spent" not in done.stdout, done.stdout
    assert " tok/s  MFU -" in rows["llama-350m fsdp2 bf16 compile"]  # no peak on a CPU
    # the moe family is another branch's: until it is merged, the row says why it is skipped
    moe = rows["moe fsdp2 bf16 compile"]
    assert " tok/s" in moe or "family moe is not known to trainer.config" in moe, moe
    diff = float(rows["ddp vs fsdp2 losses"].split("max |dloss| ")[1].split()[0])
    assert diff < 1e-4 and "2 rank(s), gloo" in rows["ddp vs fsdp2 losses"]
    assert "losses finite, falling" in rows["fp16 ddp + GradScaler"]
    gen = rows["generation vs transformers"]
    new = int(gen.split(" greedy tokens")[0].rsplit(" ", 1)[1])
    assert f"{new}/{new} leading tokens agree" in gen, gen  # fp32: the same greedy tokens


@pytest.mark.parametrize(
    "name, bf16, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12, 66.9e12),  # SXM
        ("NVIDIA H100 PCIe", 756.0e12, 51.2e12),
        ("NVIDIA H100 NVL", 835.0e12, 60.0e12),
        ("NVIDIA H200", 989.4e12, 66.9e12),  # SXM
        ("NVIDIA H200 NVL", 835.0e12, 60.0e12),
        ("NVIDIA GH200 480GB", 989.4e12, 66.9e12),
        ("NVIDIA A100-SXM4-80GB", 312.0e12, 19.5e12),
    ],
)
def test_peak_flops_of_the_devices(name: str, bf16: float, fp32: float) -> None:
    assert (peak_flops_of(name, "bf16"), peak_flops_of(name, "fp32")) == (bf16, fp32)
    assert peak_flops_of("Some Future GPU", "bf16") is None
