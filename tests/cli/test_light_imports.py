"""The client commands import neither torch, Celery nor SQLAlchemy, so they start fast."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli.conftest import trainq_argv

# redis too: `pip install --no-deps trainq` plus httpx, typer and pyyaml runs the client.
# (Recent typer imports pydantic itself, so pydantic is not on the list.)
HEAVY = ("torch", "celery", "sqlalchemy", "kombu", "fastapi", "alembic", "numpy", "redis")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _loaded(body: str, env: dict[str, str]) -> list[str]:
    code = PROBE.format(body=body, heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout.splitlines()[-1]))


def test_importing_the_client_commands_loads_nothing_heavy(subprocess_env: dict[str, str]) -> None:
    assert (
        _loaded(
            "import service.cli, service.cli.main, service.cli.commands, service.cli.client, "
            "service.local.up",
            subprocess_env,
        )
        == []
    )


def test_submit_help_loads_nothing_heavy(subprocess_env: dict[str, str]) -> None:
    # The whole `trainq` app (service/cli/main.py), then `trainq submit --help`, in one interpreter.
    run_help = (
        "import contextlib, io\n"
        "from service.cli.main import app\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        "        app(['submit', '--help'], prog_name='trainq')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'Exit codes' in buf.getvalue(), buf.getvalue()\n"
    )
    assert _loaded(run_help, subprocess_env) == []


def test_submit_help_documents_the_exit_codes(subprocess_env: dict[str, str]) -> None:
    out = subprocess.run(
        [*trainq_argv(), "submit", "--help"],
        env={**subprocess_env, "COLUMNS": "200", "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for code, meaning in [
        ("0", "the job succeeded"),
        ("1", "it failed"),
        ("3", "it was cancelled"),
        ("4", "it timed out"),
        ("5", "the service is unreachable"),
        ("6", "the API refused the request"),
    ]:
        assert f"{code} {meaning}" in text, text
