"""Slow preparations the suite starts the moment it knows its tests, at a low CPU priority
(nice 10), so that they run on the CPU the other tests leave idle (waiting on polls,
heartbeats and subprocesses); the test that needs one waits only for what is left of it.

- mypy over the packages (tests/test_lint.py::test_mypy): a cold run takes minutes of one core.
- The fresh virtual environment of tests/cli/test_up.py: torch, transformers and a copy of
  the repository installed by pip, minutes of unpacking.

tests/conftest.py starts each one whose test was collected, and stops what is still running
(its own process group, by id) and removes its folder when the session ends.

Under pytest-xdist (`-n 2`, the suite's default), its controller is that session: it
starts each check once, when a worker's collection shows its test, and the worker that runs
the test waits on the check's folder, which every worker learns from the controller
(``workerinput``): the folder holds ``pid`` (its process group) and, once it has ended,
``rc`` (its exit code). Without this, each worker would build its own.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a user's `pip install` of the repository needs of it.
PACKAGE = ["pyproject.toml", "README.md", "service", "worker", "trainer", "migrations"]


@dataclass
class Check:
    """A command running in the background (its own process group); ``result`` waits. Any
    process of the session may wait on it: what it needs is in ``folder``."""

    folder: Path  # output.log, pid, rc once it has ended; whatever it builds
    # Where it was started (the session, or xdist's controller): what waits and stops it.
    popen: subprocess.Popen[bytes] | None = None
    reaper: threading.Thread | None = field(default=None, repr=False)

    def result(self, timeout: float) -> tuple[int, str]:
        """Its exit code and output (stdout and stderr), once it has ended. A test waits on
        it now: it goes on at the normal priority where this process may raise it."""
        rc = self.folder / "rc"
        if not rc.exists():
            try:
                os.setpriority(os.PRIO_PGRP, int((self.folder / "pid").read_text()), 0)
            except (PermissionError, ProcessLookupError):  # not ours to raise; or just ended
                pass
        deadline = time.monotonic() + timeout
        while not rc.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.folder.name}: still running after {timeout:g} s")
            time.sleep(0.2)
        return int(rc.read_text()), (self.folder / "output.log").read_text(errors="replace")

    def _reap(self) -> None:
        """In a thread of the process that started it: ``rc`` written when it ends."""
        assert self.popen is not None
        code = self.popen.wait()
        try:
            (self.folder / "rc.part").write_text(str(code))
            (self.folder / "rc.part").replace(self.folder / "rc")
        except OSError:  # stopped at the session's end, its folder removed meanwhile
            pass

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass
        if self.reaper is not None:
            self.reaper.join(10)


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
    (folder / "pid").write_text(str(popen.pid))
    check = Check(folder, popen)
    check.reaper = threading.Thread(target=check._reap, name=f"early-{folder.name}", daemon=True)
    check.reaper.start()
    return check


MYPY = "mypy"
VENV = "venv"
UP_TEST = "test_trainq_up_demo_from_a_fresh_venv"  # tests/cli/test_up.py, which VENV is for
# The checks' folder (every process of the session), and what this process started.
BASE = pytest.StashKey[Path]()
STARTED = pytest.StashKey[dict[str, Check]]()
WORKERINPUT = "trainq_early"


def start_mypy(folder: Path) -> Check:
    return start([sys.executable, "-m", "mypy"], folder)


def start_venv(root: Path) -> Check:
    """FOLDER/venv: `python -m venv` (no system site packages, no pip of its own), then
    `pip install torch==2.13.0 FOLDER/src[hf]` (the README's install; FOLDER/src a copy of
    the repository's package files) by this session's pip, without byte-compiling."""
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


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def configure(config: pytest.Config) -> None:
    """The checks' folder: the session's own, or (an xdist worker) its controller's."""
    if _is_worker(config):
        config.stash[BASE] = Path(config.workerinput[WORKERINPUT])  # type: ignore[attr-defined]
    else:
        config.stash[BASE] = Path(tempfile.mkdtemp(prefix="trainq-early-"))
        config.stash[STARTED] = {}


def configure_node(node: Any) -> None:
    """xdist's controller, for each worker it starts: where the checks are."""
    node.workerinput[WORKERINPUT] = str(node.config.stash[BASE])


def _nodeid(config: pytest.Config, module: str, name: str) -> str:
    return f"{(REPO / 'tests' / module).relative_to(config.rootpath).as_posix()}::{name}"


def start_all(config: pytest.Config, nodeids: list[str]) -> None:
    """Each check whose test is among ``nodeids`` (a collection's), once a session. Not in an
    xdist worker: its controller gets every worker's collection and starts them."""
    if config.option.collectonly or _is_worker(config):
        return
    started, base, ids = config.stash[STARTED], config.stash[BASE], set(nodeids)
    if MYPY not in started and _nodeid(config, "test_lint.py", "test_mypy") in ids:
        (base / MYPY).mkdir()
        started[MYPY] = start_mypy(base / MYPY)
    if VENV not in started and _nodeid(config, "cli/test_up.py", UP_TEST) in ids:
        (base / VENV).mkdir()
        started[VENV] = start_venv(base / VENV)


def check(config: pytest.Config, name: str) -> Check:
    """The check ``name`` (MYPY, VENV) that this session started for a test of it."""
    folder = config.stash[BASE] / name
    if not (folder / "pid").exists():
        pytest.fail(f"tests/early.py did not start {name}: was its test collected?")
    return Check(folder)


def stop_all(config: pytest.Config) -> None:
    if _is_worker(config) or BASE not in config.stash:
        return
    for started in config.stash[STARTED].values():
        started.stop()
    shutil.rmtree(config.stash[BASE], ignore_errors=True)
