"""Slow preparations the suite starts the moment it knows its tests, at a low CPU priority
(nice 10), so that they run on the CPU the other tests leave idle (waiting on polls,
heartbeats and subprocesses); the test that needs one waits only for what is left of it.

- mypy over the packages (tests/test_lint.py::test_mypy): a cold run takes minutes of one core.
- The fresh virtual environment of tests/cli/test_up.py: torch, transformers and a copy of
  the repository installed by pip, minutes of unpacking.

tests/conftest.py starts each one whose test was collected, and stops what is still running
(its own process group, by id) and removes its folder when the session ends.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a user's `pip install` of the repository needs of it.
PACKAGE = ["pyproject.toml", "README.md", "service", "worker", "trainer", "migrations"]


@dataclass
class Check:
    """A command running in the background (its own process group); ``result`` waits."""

    popen: subprocess.Popen[bytes]
    folder: Path  # its output log, and whatever it builds

    def result(self, timeout: float) -> tuple[int, str]:
        """Its exit code and output (stdout and stderr), once it has ended. A test waits on
        it now: it goes on at the normal priority where this process may raise it."""
        if self.popen.poll() is None:
            try:
                os.setpriority(os.PRIO_PROCESS, self.popen.pid, 0)
            except (PermissionError, ProcessLookupError):  # not ours to raise; or just ended
                pass
        code = self.popen.wait(timeout)
        return code, (self.folder / "output.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass
            self.popen.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _die_with_the_session() -> None:
    """In the child: SIGKILL when pytest dies (PR_SET_PDEATHSIG), so a session killed before
    its unconfigure hook (a CI timeout) leaves no check running behind it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def start(argv: list[str], folder: Path, env: dict[str, str] | None = None) -> Check:
    with (folder / "output.log").open("wb") as out:
        popen = subprocess.Popen(
            ["nice", "-n", "10", *argv], cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_the_session,
        )  # fmt: skip
    return Check(popen, folder)


MYPY = pytest.StashKey[Check]()
VENV = pytest.StashKey[Check]()


def start_mypy() -> Check:
    return start([sys.executable, "-m", "mypy"], Path(tempfile.mkdtemp(prefix="trainq-mypy-")))


def start_venv() -> Check:
    """FOLDER/venv: `python -m venv` (no system site packages, no pip of its own), then
    `pip install torch==2.13.0 FOLDER/src[hf]` (the README's install; FOLDER/src a copy of
    the repository's package files) by this session's pip, without byte-compiling."""
    root = Path(tempfile.mkdtemp(prefix="trainq-venv-"))
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGE:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    argv = [
        *(sys.executable, "-m", "pip", "--python", str(venv / "bin/python")),
        *("install", "-q", "--no-compile", "torch==2.13.0", f"{src}[hf]"),
    ]
    return start(argv, root, env)


def _collected(items: list[pytest.Item], module: str, name: str) -> bool:
    path = REPO / "tests" / module
    return any(item.path == path and item.name == name for item in items)


def start_all(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    if _collected(items, "test_lint.py", "test_mypy"):
        config.stash[MYPY] = start_mypy()
    if _collected(items, "cli/test_up.py", "test_trainq_up_demo_from_a_fresh_venv"):
        config.stash[VENV] = start_venv()


def stop_all(config: pytest.Config) -> None:
    for key in (MYPY, VENV):
        check = config.stash.get(key, None)
        if check is not None:
            check.stop()
