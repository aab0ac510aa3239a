"""Fixtures for the CLI tests: the `trainq` command as a subprocess, and a running system.

The system is the one ``tests/e2e/system.py`` starts (uvicorn API with its ingestor,
PostgreSQL, Redis, a real Celery worker launching torchrun on CPU); here it gets two APIs
on the same stores, one with auth off (most tests) and one with auth on (the 401 case).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import Api, System, build_system

# `trainq` as a user runs it: the Typer app of service/cli/main.py (the console script's target).
TRAINQ = ["-m", "service.cli"]

TINY: dict[str, Any] = {
    "name": "cli-test",
    "labels": {"purpose": "cli-test"},
    "queue": "cpu",
    "procs_per_node": 2,
    "max_runtime_s": 300,
    "train": {
        "steps": 6,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
        "data": {"path": "demo"},
        "batch": {"micro_batch_size": 4},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
    },
}


def trainq_argv() -> list[str]:
    return [sys.executable, *TRAINQ]


# Exec'd in place of the command, with SIGINT back to its default first.
_CTRL_C_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def as_in_a_terminal(argv: list[str]) -> list[str]:
    """``argv`` run with Ctrl-C's default disposition, as a shell in a terminal runs it.

    A suite started in the background (``pytest &`` in a script, a CI runner, an agent's
    shell) runs with SIGINT ignored; a child inherits that, Python then raises no
    KeyboardInterrupt, and a test's Ctrl-C does nothing. The command is exec'd (same pid)."""
    return [sys.executable, "-c", _CTRL_C_DEFAULT, *argv]


@dataclass
class Result:
    code: int
    out: str
    err: str


Run = Callable[..., Result]


@pytest.fixture()
def trainq(subprocess_env: dict[str, str]) -> Run:
    """Run `trainq ARGS...` to completion: ``trainq("ls", url=..., token=...)``."""

    def run(
        *args: str, url: str, token: str | None = None, timeout: float = 120, **env: str
    ) -> Result:
        full = {**subprocess_env, "TRAINQ_URL": url, **env}
        full.pop("TRAINQ_TOKEN", None)
        if token:
            full["TRAINQ_TOKEN"] = token
        proc = subprocess.run(
            [*trainq_argv(), *args], env=full, capture_output=True, text=True, timeout=timeout
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    return run


@dataclass
class CliSystem:
    system: System
    api: Api  # auth off
    secure: Api  # auth on, same stores
    spec_dir: Path

    def spec(self, name: str, **train: Any) -> Path:
        """A spec file: TINY with ``train`` keys replaced (one level deep merges)."""
        import yaml

        body: dict[str, Any] = {**TINY, "name": name, "train": dict(TINY["train"])}
        for key, value in train.items():
            old = body["train"].get(key)
            body["train"][key] = {**old, **value} if isinstance(old, dict) else value
        path = self.spec_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        return path


@pytest.fixture(scope="module")
def cli_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CliSystem]:
    root = tmp_path_factory.mktemp("cli")
    # A cancelled trainer saves a checkpoint on SIGTERM; it does not need 30 s for that.
    system = build_system(root, pg_url, redis_dbs, subprocess_env, {"TRAINQ_CANCEL_GRACE_S": "10"})
    specs = root / "specs"
    specs.mkdir()
    try:
        api = system.start_api(auth=False)
        secure = system.start_api(auth=True)
        system.start_worker("cpu")
        yield CliSystem(system, api, secure, specs)
    finally:
        system.stop()


def one_line(text: str) -> str:
    """The single non-empty line of ``text``; fails the test if there are more or none."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line, got {len(lines)}:\n{text}"
    assert "Traceback" not in text
    return lines[0]
