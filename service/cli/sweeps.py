"""``trainq sweep submit | list | status | cancel``: sweeps over the API (POST /v1/sweeps ...).

``register(sweep_app)`` adds them to the ``trainq sweep`` group (``service.cli.commands``).
The sweep file is YAML or JSON, read as a job spec file is (``service.cli.specfile``);
validation is the API's (a 422 names the field). ``--wait`` polls until the sweep ends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli.output import clean, fmt, table

__all__ = ["register", "sweep_rows", "trial_rows"]

POLL_S = 1.0


def trial_rows(sweep: dict[str, Any]) -> str:
    """The trials as a table, best first by the sweep's metric (trials without one last)."""
    goal = 1 if sweep.get("goal", "min") == "min" else -1
    trials = sorted(
        sweep.get("trials", []),
        key=lambda t: (t.get("value") is None, goal * (t.get("value") or 0.0), t["number"]),
    )
    paths = list(sweep.get("space", {}))
    metric = str(sweep.get("metric", "metric")).upper()
    rows = [
        [
            t["number"],
            t["job_id"],
            t["status"],
            *(fmt(t["params"].get(p), ".4g") for p in paths),
            fmt(t.get("value"), ".4f"),
            fmt(t.get("best"), ".4f"),
            fmt(t.get("step")),
        ]
        for t in trials
    ]
    header = ["TRIAL", "JOB", "STATUS", *paths, metric, "BEST", "STEP"]
    return table(rows, header) if rows else "no trials yet"


def sweep_rows(sweeps: list[dict[str, Any]]) -> str:
    """The sweeps as a table, newest first: trials made of the budget, the best value."""
    rows = [
        [
            s["id"],
            s["name"],
            s["status"],
            s["method"],
            f"{s['proposed']}/{s['budget']}",
            f"{s['metric']} {s['goal']}",
            fmt((s.get("best_trial") or {}).get("value"), ".4f"),
            str(s["created_at"])[:19],
        ]
        for s in sweeps
    ]
    header = ["ID", "NAME", "STATUS", "METHOD", "TRIALS", "METRIC", "BEST", "CREATED"]
    return table(rows, header) if rows else "no sweeps"


def _summary(sweep: dict[str, Any]) -> str:
    best = sweep.get("best_trial")
    line = (
        f"sweep {sweep['id']} {sweep['status']}: {sweep['proposed']}/{sweep['budget']} trials"
        f" ({sweep['method']}, {sweep['metric']} {sweep['goal']})"
    )
    if best:
        line += f"; best trial {best['number']} (job {best['job_id']}) {fmt(best['value'], '.4f')}"
    return clean(line)


def register(sweep_app: typer.Typer) -> None:
    """Add ``submit``, ``list``, ``status`` and ``cancel`` to the ``trainq sweep`` group."""
    from service.cli.base import cli_errors, fail, make_client
    from service.cli.specfile import SpecError, load_spec

    @sweep_app.command("submit")
    @cli_errors
    def submit(
        file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="the sweep file")],
        wait: Annotated[bool, typer.Option("--wait", help="until the sweep ends")] = False,
    ) -> None:
        """Start a sweep: trials of its base spec over its space (examples/sweep.yaml)."""
        try:
            body = load_spec(file, [])
        except SpecError as exc:
            raise fail(str(exc), 2) from None
        with make_client() as client:
            sweep = client.submit_sweep(body)
            typer.echo(clean(f"sweep {sweep['id']} submitted"))
            while wait and sweep["status"] == "running":
                time.sleep(POLL_S)
                sweep = client.sweep(sweep["id"])
        if wait:
            typer.echo(trial_rows(sweep))
            typer.echo(_summary(sweep))
            if sweep["status"] != "finished":
                raise fail(f"sweep {sweep['id']} {sweep['status']}", 3)

    @sweep_app.command("list")
    @cli_errors
    def list_(
        limit: Annotated[int, typer.Option("--limit", min=1, max=200, help="at most")] = 50,
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """Your sweeps, newest first: status, trials made of the budget, the best value."""
        with make_client() as client:
            sweeps = client.sweeps(limit)
        if as_json:
            typer.echo(json.dumps(sweeps, indent=2))
            return
        typer.echo(sweep_rows(sweeps))

    @sweep_app.command("status")
    @cli_errors
    def status(
        sweep_id: Annotated[str, typer.Argument(metavar="ID")],
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """A sweep's trials, best first by its metric, and its best trial."""
        with make_client() as client:
            sweep = client.sweep(sweep_id)
        if as_json:
            typer.echo(json.dumps(sweep, indent=2))
            return
        typer.echo(trial_rows(sweep))
        typer.echo(_summary(sweep))

    @sweep_app.command("cancel")
    @cli_errors
    def cancel(sweep_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
        """Cancel a sweep: no more trials, and its trials are cancelled."""
        with make_client() as client:
            sweep = client.sweep(sweep_id, cancel=True)
        typer.echo(_summary(sweep))
