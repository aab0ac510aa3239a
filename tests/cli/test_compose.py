"""docker-compose.yml and the Dockerfile run only real entry points of ours, with health checks.

Docker does not run on the test machines, so the files are parsed: every command of a
service built from our image must parse as a `trainq` command line through the Typer app
itself (click's own parser, the same one `trainq` uses), every service has a health check,
and every depends_on condition names a real service and a real condition.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
import yaml

from service.cli.main import app as cli_app


def _click_exception() -> type[Exception]:
    """Click's base error: recent typer vendors click, older typer uses the click package."""
    import importlib

    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            return importlib.import_module(name).ClickException
        except ImportError:
            continue
    raise ImportError("no click")


REPO = Path(__file__).resolve().parents[2]
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def trainq_group() -> Any:
    group = typer.main.get_command(cli_app)
    assert hasattr(group, "get_command"), "the trainq app is a group of commands"
    return group


def parse_trainq(argv: list[str]) -> list[str]:
    """Resolve `trainq A B --opt x` through the real click tree; the command path found."""
    assert argv[0] == "trainq", argv
    cmd = trainq_group()
    args = argv[1:]
    path = []
    while hasattr(cmd, "get_command"):  # a group: the next word names a subcommand
        assert args, f"{argv}: needs a subcommand"
        sub = cmd.get_command(typer.Context(cmd), args[0])
        assert sub is not None, f"{argv}: no command {args[0]!r}"
        path.append(args[0])
        cmd, args = sub, args[1:]
    # Parse the options exactly as `trainq` would; a bad option or value raises here.
    with cmd.make_context("trainq " + " ".join(path), list(args)) as ctx:
        assert ctx.params is not None
    return path


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _argv(value: Any) -> list[str]:
    return list(value) if isinstance(value, list) else shlex.split(value)


def _ours(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("trainq")


def test_every_command_of_our_image_is_a_trainq_entry_point() -> None:
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if _ours(s)}
    assert set(ours) >= {"migrate", "api", "worker"}
    paths = {name: parse_trainq(_argv(s["command"])) for name, s in ours.items()}
    assert paths["migrate"] == ["db", "upgrade"]
    assert paths["api"] == ["api"] and paths["worker"] == ["worker"]
    for name, s in ours.items():
        assert "entrypoint" not in s, f"{name}: the image's own entry point is trainq"
        test = s["healthcheck"]["test"]
        if test[0] == "CMD" and test[1] == "trainq":
            parse_trainq(test[1:])
        elif test[0] == "CMD" and test[1] == "python":
            assert test[2] == "-c"
            compile(test[3], f"{name}-healthcheck", "exec")  # at least valid Python


def test_every_service_has_a_healthcheck_and_real_dependencies() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "migrate", "api", "worker"} <= set(services)
    for name, s in services.items():
        check = s.get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        for dep, cond in (s.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in CONDITIONS, f"{name} -> {dep}: {cond}"


def test_api_has_auth_on_and_the_worker_no_database() -> None:
    services = _compose()["services"]
    assert services["api"]["environment"]["TRAINQ_AUTH"] == "on"
    assert "--host" in services["api"]["command"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    worker = services["worker"]
    assert not any("DATABASE" in k for k in worker["environment"]), "workers hold no DB credentials"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_dockerfile_is_slim_non_root_and_takes_a_torch_index() -> None:
    text = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    assert any(ln.startswith("ARG TORCH_INDEX=") for ln in lines)
    assert any("--index-url" in ln and "$TORCH_INDEX" in ln for ln in lines)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    cmd = next(ln for ln in reversed(lines) if ln.startswith("CMD "))
    parse_trainq(json.loads(cmd[4:]))
    # Everything the package needs at run time is copied in.
    for folder in ("service", "worker", "trainer", "migrations"):
        assert any(ln.startswith(f"COPY {folder} ") for ln in lines), folder


@pytest.mark.parametrize(
    "argv",
    [["trainq", "api", "--hots", "0.0.0.0"], ["trainq", "nope"], ["trainq", "db", "upgrayed"]],
)
def test_the_check_refuses_what_trainq_would(argv: list[str]) -> None:
    with pytest.raises((AssertionError, _click_exception())):
        parse_trainq(argv)


def test_the_worker_host_compose_file_runs_a_gpu_worker_on_the_host_network() -> None:
    """docker-compose.worker.yml: one worker per GPU host, no database, the NVIDIA runtime,
    host networking (other hosts reach its rendezvous and collectives), shared storage."""
    services = yaml.safe_load((REPO / "docker-compose.worker.yml").read_text())["services"]
    assert set(services) == {"worker"}
    worker = services["worker"]
    assert parse_trainq(_argv(worker["command"])) == ["worker"]
    assert worker["runtime"] == "nvidia" and worker["network_mode"] == "host"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    env = worker["environment"]
    assert not any("DATABASE" in k for k in env), "workers hold no DB credentials"
    assert {"TRAINQ_REDIS_URL", "TRAINQ_BROKER_URL", "TRAINQ_ADVERTISE_HOST"} <= set(env)
    assert {v.split(":")[-1] for v in worker["volumes"]} == {"/data", "/runs"}
    assert (env["TRAINQ_DATA_ROOT"], env["TRAINQ_RUNS_ROOT"]) == ("/data", "/runs")
    compile(worker["healthcheck"]["test"][3], "worker-healthcheck", "exec")


def test_docker_compose_accepts_the_worker_host_file() -> None:
    import os
    import shutil
    import subprocess

    docker = shutil.which("docker")
    ok = docker is not None and (
        subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        ).returncode
        == 0
    )
    if not ok:
        pytest.skip("docker compose is not installed here")
    assert docker is not None
    done = subprocess.run(
        [docker, "compose", "-f", str(REPO / "docker-compose.worker.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "TRAINQ_CENTRAL": "10.0.0.5"},
    )
    assert done.returncode == 0, done.stderr
