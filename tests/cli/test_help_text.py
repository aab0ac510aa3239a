"""What a newcomer reads first: `--help` wrapped once, and a README command table that lists
every command `trainq --help` (and each group's help) has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import typer

from service.cli.main import app
from tests.cli.conftest import trainq_argv

GROUPS = ("data", "db", "sweep", "token")


def _commands() -> dict[str, Any]:
    """Every command of `trainq` by its path ("submit", "token limits")."""
    root: Any = typer.main.get_command(app)
    found: dict[str, Any] = {}
    for name, cmd in root.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer's own click, not the click package's)
            found.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            found[name] = cmd
    return found


def test_no_epilog_has_a_hard_line_break_inside_a_paragraph() -> None:
    # typer keeps an epilog's newlines and wraps each line again: ragged half-lines.
    for path, cmd in _commands().items():
        for paragraph in (cmd.epilog or "").strip().split("\n\n"):
            assert "\n" not in paragraph.strip(), f"trainq {path}: {paragraph!r}"


def test_submit_help_is_wrapped_once_in_80_columns(subprocess_env: dict[str, str]) -> None:
    out = subprocess.run(
        [*trainq_argv(), "submit", "--help"],
        env={**subprocess_env, "COLUMNS": "80", "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    # The epilog: the text after the last box. Every line but its last is filled.
    last_box = max(i for i, line in enumerate(lines) if line.startswith("╰"))
    epilog = [line.strip() for line in lines[last_box + 1 :] if line.strip()]
    assert epilog and epilog[0].startswith("Exit codes"), lines
    short = [line for line in epilog[:-1] if len(line) < 60]
    assert short == [], f"ragged lines in an 80-column terminal: {short}"


def test_the_readme_table_lists_every_command(repo_root: Path) -> None:
    readme = (repo_root / "README.md").read_text()
    section = readme.split("## The command line", 1)[1].split("\n## ", 1)[0]
    listed: set[str] = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        first_cell = re.split(r"(?<!\\)\|", row)[1]
        for usage in re.findall(r"`([^`]+)`", first_cell):
            words = usage.removeprefix("trainq ").split()
            if words and words[0] in GROUPS and len(words) > 1:
                listed.add(" ".join(words[:2]))
            elif words and re.fullmatch(r"[a-z]+", words[0]):
                listed.add(words[0])
    missing = sorted(set(_commands()) - listed)
    assert missing == [], f"commands missing from the README's table: {missing}"
