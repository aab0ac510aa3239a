"""Shared by the trainer tests and `regen_golden`: the tiny corpus, the debug config, launchers.

The debug model (2 layers, 2 heads, width 32, seq 32, bytes) trains on a corpus of random
sentences over a 15-word vocabulary, so the loss falls from ln(256) ~ 5.5 to ~3 in 20 steps.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import write_shard

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden") / "debug_model_losses.json"
LLAMA_GOLDEN = Path(__file__).with_name("golden") / "llama_debug_losses.json"
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"),
    *("and", "cat", "runs", "far", "away", "home"),
]

# One optimizer step sees 8 samples: one process with micro batch 8, or 2 ranks with 4.
DEBUG_CONFIG: dict[str, Any] = {
    "strategy": "ddp",
    "precision": "fp32",
    "steps": 20,
    "seed": 1,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "tiny"},
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
    "optim": {"lr": 1.0e-2, "warmup_steps": 2, "grad_clip": 1.0},
    "eval": {"every": 10, "steps": 2},
    "checkpoint": {"every": 10, "keep": 2},
    "log_every": 1,
}


def write_corpus(data_root: Path) -> Path:
    """data_root/tiny/{train,val}_000.bin: ~28k bytes of word salad, deterministic."""
    rng = np.random.default_rng(0)
    text = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 6000)).encode()
    tokens = np.frombuffer(text, dtype=np.uint8)
    cut = int(len(tokens) * 0.9)
    folder = data_root / "tiny"
    write_shard(folder / "train_000.bin", tokens[:cut])
    write_shard(folder / "val_000.bin", tokens[cut:])
    return folder


def config(**overrides: Any) -> dict[str, Any]:
    """DEBUG_CONFIG with overrides; a dict value updates that section."""
    cfg = copy.deepcopy(DEBUG_CONFIG)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def argv(cfg_path: Path, run_dir: Path, data_root: Path, nproc: int) -> list[str]:
    tail = ["-m", "trainer", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    tail += ["--data-root", str(data_root)]
    if nproc == 1:
        return [sys.executable, *tail]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc-per-node={nproc}", *tail]


def start(
    cfg: dict[str, Any],
    run_dir: Path,
    data_root: Path,
    env: dict[str, str],
    nproc: int = 2,
    umask: int = -1,
) -> subprocess.Popen[str]:
    """Launch a run in its own session, so a test can signal the whole process group.
    ``umask`` is the one the run starts with (-1: the test's own)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / f"{run_dir.name}.json"
    # No Hugging Face folder at the end unless the config asks (checkpoint.hf: ~3-8 s a run
    # here, importing transformers mostly); tests/api/test_checkpoints.py asks for one.
    checkpoint = {"hf": "none", **cfg.get("checkpoint", {})}
    cfg_path.write_text(json.dumps({**cfg, "checkpoint": checkpoint}))
    return subprocess.Popen(
        argv(cfg_path, run_dir, data_root, nproc),
        env=env,
        cwd=REPO,
        text=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        umask=umask,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not finish within {timeout}s:\n{out}") from None
    return proc.returncode, out


def run(
    cfg: dict[str, Any],
    run_dir: Path,
    data_root: Path,
    env: dict[str, str],
    nproc: int = 2,
    timeout: float = 120,
    umask: int = -1,
) -> tuple[int, str]:
    return finish(start(cfg, run_dir, data_root, env, nproc, umask), timeout)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (run killed after it, then resumed) keeps the last."""
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def run_losses(
    cfg: dict[str, Any], run_dir: Path, data_root: Path, env: dict[str, str], nproc: int
) -> list[float]:
    """Run ``cfg`` to its end (it must succeed); its per-step losses in step order."""
    code, out = run(cfg, run_dir, data_root, env, nproc=nproc)
    assert code == 0, out
    got = losses(run_dir)
    return [got[s] for s in sorted(got)]


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[str]
) -> None:
    """Poll until ``predicate``; fail (and kill the run) if it exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"run exited ({proc.returncode}) before {what}:\n{out}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def fsdp_config(**overrides: Any) -> dict[str, Any]:
    """The FSDP reference: 2 ranks x 2 micro-steps x 2 samples, the same 8 samples a step,
    so it also covers gradient accumulation (no reduce-scatter on micro-step 0)."""
    cfg = config(strategy="fsdp", batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def golden_config() -> dict[str, Any]:
    """The golden run's config: one process with micro batch 8 (what 2 ranks x 4 see)."""
    return config(batch={"micro_batch_size": 8})


def golden_run(tmp: Path, env: dict[str, str], cfg: dict[str, Any] | None = None) -> list[float]:
    """Run a golden config (the GPT's by default) in one process; its per-step losses."""
    if not (tmp / "data").exists():
        write_corpus(tmp / "data")
    name = "golden" if cfg is None else f"golden-{cfg['model'].get('family', 'gpt')}"
    code, out = run(cfg or golden_config(), tmp / name, tmp / "data", env, nproc=1)
    assert code == 0, out
    got = losses(tmp / name)
    return [got[s] for s in sorted(got)]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc): torchrun's ranks and their children."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def modes(root: Path) -> dict[str, str]:
    """Everything under ``root`` (not itself) as relative path -> mode, like ``0o640``."""
    return {
        str(p.relative_to(root)) + ("/" if p.is_dir() else ""): oct(p.lstat().st_mode & 0o777)
        for p in sorted(root.rglob("*"))
    }


def wrong_modes(root: Path) -> dict[str, str]:
    """What under ``root`` is not a 0750 folder or a 0640 file (trainer.files)."""
    return {
        path: mode
        for path, mode in modes(root).items()
        if mode != (oct(0o750) if path.endswith("/") else oct(0o640))
    }
