"""The code base stays ruff- and mypy-clean: a lint or type regression fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import early

REPO = Path(__file__).resolve().parent.parent
PATHS = ["trainer", "service", "worker", "migrations", "tests", "bench"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("command", [("ruff", "check"), ("ruff", "format", "--check")])
def test_ruff(command: tuple[str, ...]) -> None:
    result = _run(*command, *PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy(request: pytest.FixtureRequest) -> None:
    # Started when the session collected this test (tests/early.py); its result is read here.
    code, output = early.check(request.config, early.MYPY).result(timeout=600)
    assert code == 0, output
