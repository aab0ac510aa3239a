"""The trainq command on the embedded SQLite store; imports checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from service.api.app import create_app
from service.api.core import migrate
from service.api.core.settings import Settings
from service.cli import main as cli


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _trainq(env: dict[str, str], *args: str) -> Ran:
    """In-process, with the environment a shell would give it (the settings read it)."""
    result = CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)
    return Ran(result.exit_code, result.stdout, result.stderr)


@pytest.fixture()
def cli_env(tmp_path: Path) -> dict[str, str]:
    db = tmp_path / "state" / "trainq.db"  # the folder does not exist yet
    return {"TRAINQ_DATABASE_URL": f"sqlite:///{db}"}


def test_db_upgrade_token_lifecycle(cli_env: dict[str, str], redis_url: str) -> None:
    up = _trainq(cli_env, "db", "upgrade")
    assert up.returncode == 0, up.stderr
    head = ScriptDirectory.from_config(migrate.alembic_config(cli_env["TRAINQ_DATABASE_URL"]))
    assert up.stdout.strip().endswith(f"revision {head.get_current_head()}")

    made = _trainq(cli_env, "token", "create", "--name", "ci")
    assert made.returncode == 0, made.stderr
    lines = made.stdout.strip().splitlines()
    token = lines[-1]
    assert token.startswith("tq_") and len(token) > 30 and " " not in token
    assert token not in "\n".join(lines[:-1])  # printed once, alone on the last line

    admin = _trainq(cli_env, "token", "create", "--name", "ops", "--admin")
    assert admin.returncode == 0 and "admin" in admin.stdout

    listed = _trainq(cli_env, "token", "list")
    assert listed.returncode == 0
    assert "ci\tuser" in listed.stdout and "ops\tadmin" in listed.stdout
    assert token not in listed.stdout  # only hashes are stored

    settings = Settings(
        database_url=cli_env["TRAINQ_DATABASE_URL"],
        redis_url=redis_url,
        ingest=False,
        reconcile=False,
        token_cache_s=0,
    )
    with TestClient(create_app(settings)) as client:
        h = {"Authorization": f"Bearer {token}"}
        assert client.get("/v1/jobs", headers=h).status_code == 200
        assert _trainq(cli_env, "token", "revoke", "--name", "ci").returncode == 0
        assert client.get("/v1/jobs", headers=h).status_code == 401
    again = _trainq(cli_env, "token", "revoke", "--name", "ci")
    assert again.returncode == 1 and "revoked 0" in again.stdout

    bad = _trainq(cli_env, "token", "revoke")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_cli_imports_neither_torch_nor_celery(subprocess_env: dict[str, str]) -> None:
    code = (
        "import sys, service.cli.main, service.api.app\n"
        "heavy = [m for m in ('torch', 'celery') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_worker_command_hands_over_to_the_worker_package(cli_env: dict[str, str]) -> None:
    helped = _trainq(cli_env, "worker", "--help")
    assert helped.returncode == 0
    for option in ("--queues", "--slots", "--gpus", "--hostname"):
        assert option in helped.stdout
    bad = _trainq(cli_env, "worker", "--gpus", "zero")
    assert bad.returncode == 2 and "GPU indices" in bad.stderr
