"""Trainer fixtures: the tiny corpus and the reference runs several tests share.

Starting torchrun costs seconds on two cores, so the one-process, DDP and FSDP runs of the
debug config happen once per session and the equality, loss-falls, golden and resume tests
all read them. They start with umask 0, the most permissive, so the modes of what they
write show the trainer's own policy (trainer.files) and nothing of the test's umask.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.trainer import runs


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-data")
    runs.write_corpus(root)
    return root


def _reference(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    cfg: dict[str, object],
    data_root: Path,
    env: dict[str, str],
    nproc: int,
) -> Path:
    run_dir = tmp_path_factory.mktemp("ref") / name
    code, out = runs.run(cfg, run_dir, data_root, env, nproc=nproc, umask=0)
    assert code == 0, out
    return run_dir


@pytest.fixture(scope="session")
def single_run(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> Path:
    """One process, micro batch 8: the golden config.

    It runs with TRAINQ_REDIS_URL pointing at a port where nothing listens, so every test
    that compares against it also shows that an unreachable Redis changes nothing.
    """
    with socket.socket() as s:  # free a moment ago, so nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        subprocess_env,
        TRAINQ_REDIS_URL=f"redis://127.0.0.1:{port}/0",
        TRAINQ_JOB_ID="job-dead-redis",
    )
    return _reference(tmp_path_factory, "single", runs.golden_config(), data_root, env, 1)


@pytest.fixture(scope="session")
def ddp_run(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> Path:
    """2-rank DDP, micro batch 4, 20 steps straight (checkpoints at 10 and 20)."""
    return _reference(tmp_path_factory, "ddp", runs.config(), data_root, subprocess_env, 2)


@pytest.fixture(scope="session")
def fsdp_run(
    tmp_path_factory: pytest.TempPathFactory, data_root: Path, subprocess_env: dict[str, str]
) -> Path:
    """2-rank FSDP2 with gradient accumulation (2 x 2 samples), 20 steps straight."""
    cfg = runs.fsdp_config()
    return _reference(tmp_path_factory, "fsdp", cfg, data_root, subprocess_env, 2)
