"""`trainq up` from the repository: auth on (token file, 401 without it), SIGTERM, refusals
(a second `trainq up` in one data folder among them), the banner's hints, and what it reads
off the machine (GPU names to queues, Redis URLs). The tests that only look at a running
`trainq up` with auth off share one (``up_auth_off``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.local.embedded import _gpu_model, db_number, is_loopback, with_db
from tests.cli.conftest import one_line, trainq_argv
from tests.e2e.system import free_port, wait_for

pytestmark = pytest.mark.timeout(180)


def _env(subprocess_env: dict[str, str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("TRAINQ_")}
    return {**env, **extra}


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False


def test_up_with_auth_on_writes_an_admin_token_and_stops_on_sigterm(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "d"
    children: list[int] = []
    up = subprocess.Popen(
        [*trainq_argv(), "up", "--port", str(port), "--data-dir", str(data)],
        env=_env(subprocess_env, TRAINQ_AUTH="on"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    banner: list[str] = []
    try:
        # Printed once `trainq up` itself found everything ready: the API answering the
        # test's own poll may come first, and a SIGTERM then would stop it before the banner.
        banner = _banner(up)
        token_file = data / "admin-token"
        token = token_file.read_text().strip()
        assert token and token_file.stat().st_mode & 0o777 == 0o600
        auth = {"Authorization": f"Bearer {token}"}

        def ready() -> bool:
            assert up.poll() is None, up.stderr.read() if up.stderr else ""
            try:
                r = httpx.get(f"{url}/v1/workers", headers=auth, timeout=2)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and bool(r.json()["items"])

        wait_for(ready, 90, "trainq up to be ready")
        assert httpx.get(f"{url}/v1/workers", timeout=2).status_code == 401
        children = [
            int(p) for p in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split()
        ]
        assert len(children) >= 3  # redis, worker, api: each leads its own process group
    finally:
        up.send_signal(signal.SIGTERM)
        rest, err = up.communicate(timeout=90)
    out = "\n".join([*banner, rest])
    assert up.returncode == 0, err
    assert "auth on: export TRAINQ_TOKEN=$(cat" in out and "stopped; no process left." in out
    assert not any(_group_alive(pid) for pid in children)


def test_up_refuses_a_public_address_with_auth_off(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    r = subprocess.run(
        [*trainq_argv(), "up", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "d")],
        env=_env(subprocess_env, TRAINQ_AUTH="off"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "refusing to bind 0.0.0.0 with TRAINQ_AUTH=off" in one_line(r.stderr)
    assert not (tmp_path / "d").exists()  # refused before anything was made or started


def test_up_refuses_a_port_in_use(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [*trainq_argv(), "up", "--port", str(port), "--data-dir", str(tmp_path / "d")],
            env=_env(subprocess_env),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in one_line(r.stderr)


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA L40S", "l40s"),
    ],
)
def test_gpu_names_become_queue_names(name: str, model: str) -> None:
    assert _gpu_model(name) == model


def test_addresses_and_redis_urls() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert with_db("redis://:pw@h:6380/0", 1) == "redis://:pw@h:6380/1"
    assert db_number("redis://h:6379/7") == 7 and db_number("redis://h:6379") == 0


def _start_up(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _banner(up: subprocess.Popen[str]) -> list[str]:
    """The lines `trainq up` printed up to "Ctrl-C stops everything." (it is then ready)."""
    assert up.stdout is not None
    lines: list[str] = []
    for line in up.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C stops everything."):
            return lines
    raise AssertionError(f"trainq up ended early: {lines} {up.stderr.read() if up.stderr else ''}")


def _stop(up: subprocess.Popen[str]) -> tuple[str, str]:
    up.send_signal(signal.SIGTERM)
    try:
        return up.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        up.kill()
        return up.communicate(timeout=10)


@dataclass
class Up:
    popen: subprocess.Popen[str]
    banner: list[str]  # what it printed up to "Ctrl-C stops everything."
    data: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def up_auth_off(
    subprocess_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, repo_root: Path
) -> Iterator[Up]:
    """One `trainq up` (auth off, from the repository) for the tests that only look at it: the
    banner's hints, a second `trainq up` in its folder. It must stop cleanly on SIGTERM."""
    # The console script, as the README installs it, when this environment has one.
    script = Path(sys.executable).parent / "trainq"
    cmd = [str(script)] if script.exists() else trainq_argv()
    data = tmp_path_factory.mktemp("up") / "d"
    env = _env(subprocess_env)
    up = _start_up(
        [*cmd, "up", "--port", str(free_port()), "--data-dir", str(data)], env, repo_root
    )
    try:
        banner = _banner(up)
    except BaseException:
        _stop(up)
        raise
    yield Up(up, banner, data, env)
    _, err = _stop(up)
    assert up.returncode == 0, err


def test_a_second_up_in_the_same_data_folder_is_refused(up_auth_off: Up) -> None:
    data, first = up_auth_off.data, up_auth_off.popen
    # Another free port: only the folder is shared (its Redis AOF, its SQLite).
    second = subprocess.run(
        [*trainq_argv(), "up", "--data-dir", str(data), "--port", str(free_port())],
        env=up_auth_off.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1, second
    assert one_line(second.stderr) == (
        f"trainq up: error: another trainq up is running with data folder {data.resolve()} "
        f"(pid {first.pid})"
    )
    assert second.stdout == ""  # refused before it started anything
    assert (data / "up.lock").read_text().strip() == str(first.pid)
    assert first.poll() is None  # the first goes on


def test_the_banner_hints_run_as_printed_without_demo(up_auth_off: Up, repo_root: Path) -> None:
    banner, data, env = up_auth_off.banner, up_auth_off.data, up_auth_off.env
    hints = [line.strip() for line in banner if line.strip().startswith("TRAINQ_URL=")]
    assert [h.split()[-1] for h in hints] == ["workers", "--follow"], banner
    workers, submit = hints
    assert submit.endswith(" submit examples/tiny-ddp.yaml --follow"), submit
    assert (data / "data/demo").is_dir()  # the examples' dataset, without --demo
    # Each hint as a user pastes it into a shell, from the folder trainq up ran in.
    r = subprocess.run(
        ["bash", "-c", workers], env=env, cwd=repo_root, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("NAME"), r
    r = subprocess.run(
        ["bash", "-c", f"{submit} --set train.steps=2"],
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r
    assert " succeeded; final loss " in r.stdout, r
    assert "None" not in r.stdout + r.stderr
