"""The admin commands (`trainq db ...`, `trainq token ...`) act on the instance the user runs:
the database `trainq up` chose (``--data-dir``, or TRAINQ_DATABASE_URL), and outside any
instance one line says what to set, never a SQLAlchemy traceback."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from service.cli import main as cli
from tests.cli.conftest import one_line, trainq_argv
from tests.e2e.system import free_port

WHAT_TO_SET = ("--data-dir", "TRAINQ_DATABASE_URL")


def _trainq(*args: str, **env: str | None) -> tuple[int, str, str]:
    """In-process, with no TRAINQ_DATABASE_URL unless given: a user's shell."""
    full: dict[str, str | None] = {"TRAINQ_DATABASE_URL": None, **env}
    result = CliRunner().invoke(cli.app, list(args), env=full, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_data_dir_picks_the_instance_and_the_default_is_up_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "elsewhere"
    code, out, err = _trainq("db", "upgrade", "--data-dir", str(d))
    assert code == 0, err
    assert (d / "trainq.db").is_file() and not (tmp_path / ".trainq").exists()
    code, out, err = _trainq("token", "create", "--name", "ci", "--data-dir", str(d))
    assert code == 0, err
    listed = _trainq("token", "list", "--data-dir", str(d))
    assert listed[0] == 0 and "ci\tuser" in listed[1]
    limits = _trainq("token", "limits", "ci", "--max-queued", "3", "--data-dir", str(d))
    assert limits[0] == 0 and "max_queued=3" in limits[1], limits
    assert _trainq("db", "current", "--data-dir", str(d))[1].strip() != "(empty)"

    # No flag: .trainq here, the folder a plain `trainq up` uses; it does not exist yet.
    code, out, err = _trainq("token", "list")
    assert code == 2 and out == ""
    line = one_line(err)
    assert "no trainq instance here" in line and all(w in line for w in WHAT_TO_SET), line
    assert not (tmp_path / ".trainq").exists()  # nothing was created by asking
    assert _trainq("db", "upgrade")[0] == 0
    assert (tmp_path / ".trainq" / "trainq.db").is_file()
    assert _trainq("token", "create", "--name", "here")[0] == 0
    here = _trainq("token", "list")[1]
    assert "here\tuser" in here and "ci\t" not in here  # another instance's tokens


@pytest.mark.parametrize(
    "args",
    [
        ("token", "create", "--name", "x"),
        ("token", "list"),
        ("token", "revoke", "--name", "x"),
        ("token", "limits"),
        ("token", "tracking", "x"),
        ("db", "current"),
        ("db", "downgrade", "base"),
    ],
)
def test_outside_any_instance_one_line_says_what_to_set(
    args: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for extra in ((), ("--data-dir", str(tmp_path / "missing"))):
        code, out, err = _trainq(*args, *extra)
        assert code == 2, (code, out, err)
        line = one_line(err)
        assert line.startswith("trainq: error: ") and all(w in line for w in WHAT_TO_SET), line
    assert list(tmp_path.iterdir()) == []  # no empty database left behind


def test_database_errors_are_one_line_naming_the_database(tmp_path: Path) -> None:
    # A PostgreSQL that is not there: the password is not printed.
    down = f"postgresql://u:s3cret@127.0.0.1:{free_port()}/x"
    code, _, err = _trainq("token", "list", TRAINQ_DATABASE_URL=down)
    line = one_line(err)
    assert code == 2 and "cannot use the database postgresql://u:***@127.0.0.1" in line, line
    assert "s3cret" not in line and all(w in line for w in WHAT_TO_SET)

    # A database without trainq's tables: the fix is to migrate it.
    empty = tmp_path / "empty.db"
    empty.touch()
    code, _, err = _trainq(
        "token", "create", "--name", "x", TRAINQ_DATABASE_URL=f"sqlite:///{empty}"
    )
    line = one_line(err)
    assert code == 2 and "has no trainq tables" in line and "trainq db upgrade" in line, line

    # TRAINQ_DATABASE_URL naming a file that is not there.
    gone = tmp_path / "gone.db"
    code, _, err = _trainq("token", "list", TRAINQ_DATABASE_URL=f"sqlite:///{gone}")
    assert code == 2 and f"TRAINQ_DATABASE_URL names {gone}" in one_line(err)
    assert not gone.exists()

    code, _, err = _trainq("token", "list", TRAINQ_DATABASE_URL="not a url")
    assert code == 2 and "TRAINQ_DATABASE_URL is not a database URL" in one_line(err)


@pytest.mark.timeout(180)
def test_a_token_created_with_up_s_data_dir_is_one_that_up_accepts(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("TRAINQ_")}
    env["TRAINQ_AUTH"] = "on"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "d"
    up = subprocess.Popen(
        [*trainq_argv(), "up", "--port", str(port), "--data-dir", str(data)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        banner: list[str] = []
        for line in up.stdout:
            banner.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops everything."):
                break
        text = "\n".join(banner)
        assert f"  dashboard: {url}/ " in text, text
        assert httpx.get(f"{url}/", timeout=5).text.lstrip().lower().startswith("<!doctype html")
        hint = next(line for line in banner if " token create " in line).split(": ", 1)[1]
        assert f"--data-dir {data.resolve()}" in hint, hint

        # From another folder, as a second terminal would be: the flag finds the instance.
        made = subprocess.run(
            [*trainq_argv(), "token", "create", "--data-dir", str(data), "--name", "newcomer"],
            env=env, cwd=tmp_path.parent, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip().splitlines()[-1]
        seen = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=5)
        assert seen.status_code == 200, seen.text
        assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            _, err = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            _, err = up.communicate(timeout=10)
    assert up.returncode == 0, err
