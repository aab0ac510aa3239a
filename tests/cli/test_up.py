"""`trainq up --demo` from a fresh virtual environment: ready, the demo succeeds, Ctrl-C
leaves no process behind.

The environment is a real one, built in the background from the session's start
(tests/early.py): `python -m venv` (no system site packages), then
`pip install torch==2.13.0 <a copy of the repo>` (pip takes the CPU torch on this disk), so
a missing dependency or package file fails here the way it would for a new user. The
command then runs in an empty folder with no PYTHONPATH and nothing of the test session's
stores: its own SQLite, its own embedded Redis. Ctrl-C is the terminal's: SIGINT to the
whole foreground process group. Every process seen under `trainq up` while it ran is then
looked up by pid in /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests import early
from tests.e2e.system import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _tree(root: int) -> dict[int, str]:
    """Live descendants of ``root`` and their command lines."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            found[pid] = cmd
            todo.append(pid)
    return found


@pytest.fixture(scope="module")
def venv(request: pytest.FixtureRequest) -> Path:
    """The fresh environment, built while the session ran the tests before this one
    (tests/early.py: `python -m venv`, then pip installs torch and a copy of the repo)."""
    check = early.check(request.config, early.VENV)
    code, output = check.result(timeout=900)  # transformers and its dependencies too
    assert code == 0, output[-3000:]
    return check.folder / "venv"


def test_trainq_up_demo_from_a_fresh_venv(venv: Path, tmp_path: Path) -> None:
    trainq = venv / "bin/trainq"
    assert trainq.exists(), "the console script is installed"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("TRAINQ_")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        up = subprocess.Popen(
            [str(trainq), "up", "--demo", "--demo-steps", "10", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # a terminal's foreground group, for Ctrl-C
        )
    seen: dict[int, str] = {}

    def look(predicate: object) -> object:
        seen.update(_tree(up.pid))
        if up.poll() is not None:
            raise AssertionError(f"trainq up exited {up.returncode}: {err_path.read_text()}")
        return predicate() if callable(predicate) else predicate

    try:

        def ready() -> bool:
            try:
                workers = httpx.get(f"{url}/v1/workers", timeout=2).json()["items"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return any(w["name"].endswith("-cpu") and "cpu" in w["queues"] for w in workers)

        wait_for(lambda: look(ready), 120, "the API to answer and the worker to register")

        def demo() -> dict[str, object] | None:
            items = httpx.get(f"{url}/v1/jobs", params={"label": "purpose:demo"}, timeout=5)
            jobs = items.json()["items"]
            return jobs[0] if jobs and jobs[0]["status"] in ("succeeded", "failed") else None

        job = wait_for(lambda: look(demo), 240, "the demo job to end", every=0.3)
        assert job["status"] == "succeeded", job
        assert job["latest"]["step"] == 10, job
        # The default output works: the finished run has its Hugging Face folder to download.
        ckpts = httpx.get(f"{url}/v1/jobs/{job['id']}/checkpoints", timeout=5).json()["items"]
        assert "hf" in ckpts[-1]["formats"], ckpts
        # The demo's closing line follows the status the API shows, a moment later.
        closing = f"demo: job {job['id']} succeeded"
        wait_for(lambda: closing in out_path.read_text(), 30, "the demo's closing line")
        text = out_path.read_text()
        assert "trainq is up in" in text and url in text
        assert "step 10/10" in text, text
        assert (tmp_path / ".trainq/trainq.db").exists()
        kinds = " ".join(seen.values())
        assert "redis-server" in kinds and "service.cli worker" in kinds, seen
        assert any("torch" in c or "trainer" in c for c in seen.values()), seen  # the demo's run
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
            try:
                up.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(10)
                for pid in seen:
                    if _alive(pid):
                        os.kill(pid, signal.SIGKILL)
                raise
    assert up.returncode == 0, err_path.read_text()
    assert "stopped; no process left." in out_path.read_text()
    assert err_path.read_text().strip() == ""
    time.sleep(0.2)
    left = {pid: cmd for pid, cmd in seen.items() if _alive(pid)}
    assert left == {}, f"left behind: {left}"
