"""The client commands of ``trainq``: submit, ls, status, logs, cancel, rm, metrics, workers,
queues, data.

``register(app)`` adds them to the ``trainq`` Typer app (``service/cli/main.py``). They speak to
the API over HTTP (``TRAINQ_URL``, default ``http://127.0.0.1:8000``; ``TRAINQ_TOKEN``) and
import only typer, httpx and yaml, never torch, Celery or SQLAlchemy, so they start fast;
httpx itself is imported when a command runs, not for ``--help``. ``data prepare`` loads the
trainer's shard writer (numpy) only when it runs.

Every failure is one line on stderr (``trainq: error: ...``), never a traceback, with the
exit codes of ``service.cli.client`` (documented in ``trainq submit --help``). What the
server sent is printed through ``service.cli.output`` (``clean``), never raw, except a
job's own log text.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer

from service.cli.base import cli_errors, fail, make_client
from service.cli.output import (
    clean,
    fmt,
    job_rows,
    job_status,
    outcome_line,
    table,
    trainq_command,
)
from service.cli.plan_view import plan_text
from service.cli.specfile import load_spec

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = ["register", "wait_for_job"]

P = ParamSpec("P")
R = TypeVar("R")

# One paragraph, no hard line breaks: typer's rich help keeps every newline of an epilog
# and then wraps each line again to the terminal, which leaves ragged half-lines.
EXIT_CODES_HELP = (
    "Exit codes with --wait (and --follow): 0 the job succeeded; 1 it failed; 2 bad usage, an "
    "unreadable spec file or a malformed TRAINQ_URL; 3 it was cancelled; 4 it timed out "
    "(max_runtime_s, or --timeout while waiting: the job keeps going); 5 the service is "
    "unreachable or unavailable (or TRAINQ_URL is not a trainq API); 6 the API refused the "
    "request (401, 403, 404, 409, 413, 422: the message names the field; 429: over a submit "
    "limit, which --wait retries after Retry-After until --timeout); 130 Ctrl-C while waiting "
    "(the job keeps going)."
)


def _show(out: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    """What the API answered: its JSON as it came (``--json``), else ``text`` of it."""
    typer.echo(json.dumps(out, indent=2) if as_json else text(out))


# -- waiting and following --------------------------------------------------------------------


def _final(client: Client, job_id: str) -> dict[str, Any]:
    from service.cli.client import TERMINAL

    job = client.job(job_id)
    # The stream's terminal event can come a moment before the row says so.
    for _ in range(20):
        if job.get("status") in TERMINAL:
            break
        time.sleep(0.25)
        job = client.job(job_id)
    return job


def _left_waiting(client: Client, job_id: str, known: dict[str, Any] | None) -> str:
    """What becomes of a job we stop waiting for, and how to cancel it: for the last line."""
    from service.cli.client import TERMINAL, ClientError

    try:  # the record says best; a short wait only, the user is leaving
        known = client.job(job_id, timeout=2.0)
    except ClientError:
        pass
    status = (known or {}).get("status")
    cancel = f"cancel it with `{trainq_command()} cancel {job_id}`"
    if status == "queued":
        why = (known or {}).get("pending_reason")
        return f"job {job_id} stays queued{f' ({why})' if why else ''}; {cancel}"
    if status == "cancelling":
        return f"job {job_id} is being cancelled"
    if status in TERMINAL:
        return f"job {job_id} {status}"
    if status is None:
        return f"job {job_id} was not cancelled; {cancel}"
    return f"job {job_id} keeps running; {cancel}"


def _leaving(line: str) -> None:
    typer.echo(clean(line), err=True)


def wait_for_job(
    client: Client, job_id: str, *, follow: bool, timeout: float | None, quiet: bool = False
) -> int:
    """Follow the job's events until it ends; its exit code (see EXIT_CODES_HELP).

    ``timeout`` holds in every state, a queued job's silence included; on it, or on Ctrl-C,
    one line says the job goes on and how to cancel it (exit 4, exit 130).
    """
    from service.cli.client import EXIT_INTERRUPTED, EXIT_TIMEOUT, PENDING_EVERY_S, exit_code_for
    from service.cli.output import Progress

    progress = Progress() if follow else None
    deadline = time.monotonic() + timeout if timeout is not None else None
    known: dict[str, Any] | None = None  # the status we saw last, for the leaving line
    events = client.follow_events(
        job_id, deadline=deadline, pending_every_s=PENDING_EVERY_S if follow else None
    )
    try:
        for ev in events:
            if ev.event in ("status", "pending"):
                known = ev.data
            if progress is not None:
                progress.event(ev.event, ev.data)
    except TimeoutError:
        if progress is not None:
            progress.close()
        left = _left_waiting(client, job_id, known)
        _leaving(f"trainq: error: gave up waiting after {timeout:g}s: {left}")
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        events.close()
        if progress is not None:
            progress.close()
        typer.echo("", err=True)  # after the ^C the terminal echoed
        left = _left_waiting(client, job_id, known)
        _leaving(f"trainq: stopped waiting (Ctrl-C): {left}")
        return EXIT_INTERRUPTED
    finally:
        if progress is not None:
            progress.close()
    job = _final(client, job_id)
    code = exit_code_for(job.get("status"), job.get("reason"))
    if not quiet or code:
        typer.echo(outcome_line(job), err=bool(code))
    return code


def _submit_retrying(
    client: Client, spec: dict[str, Any], key: str | None, deadline: float | None
) -> tuple[dict[str, Any], bool]:
    """Submit; a 429 (over a submit limit) is retried after its Retry-After, one line on
    stderr each time, until the deadline (--timeout): past it, the 429 is the error.
    Returns the job and whether any retry was needed."""
    from service.cli.client import EXIT_TIMEOUT, RateLimited

    retried = False
    while True:
        try:
            return client.submit(spec, key), retried
        except RateLimited as exc:
            retried = True
            pause = exc.retry_after if exc.retry_after is not None else 5.0
            if deadline is not None and time.monotonic() + pause > deadline:
                raise fail(f"gave up at --timeout: {exc.message}", EXIT_TIMEOUT) from None
            _leaving(f"trainq: submit refused: {exc.message}; retrying in {pause:g}s")
            time.sleep(pause)


# -- the commands ---------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    """Add the client commands (and ``data prepare``) to the ``trainq`` app."""
    data_app = typer.Typer(help="Datasets: token shards for the trainer.", no_args_is_help=True)
    app.add_typer(data_app, name="data")
    from service.cli.datasets import register as register_datasets  # upload, list, show, rm

    register_datasets(data_app)
    sweep_app = typer.Typer(help="Sweeps: searches over a spec's fields.", no_args_is_help=True)
    app.add_typer(sweep_app, name="sweep")
    from service.cli.sweeps import register as register_sweeps  # submit, status, cancel

    register_sweeps(sweep_app)

    @app.command("submit", epilog=EXIT_CODES_HELP)
    @cli_errors
    def submit(
        spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="job spec, YAML or JSON")],
        wait: Annotated[
            bool, typer.Option("--wait", help="wait for the end; exit code from the outcome")
        ] = False,
        follow: Annotated[
            bool, typer.Option("--follow", help="show live progress until the end (implies --wait)")
        ] = False,
        idempotency_key: Annotated[
            str | None,
            typer.Option("--idempotency-key", help="submitting the same key again is a no-op"),
        ] = None,
        overrides: Annotated[
            list[str] | None,
            typer.Option("--set", metavar="KEY.PATH=VALUE", help="override a spec value"),
        ] = None,
        timeout: Annotated[
            float | None, typer.Option("--timeout", help="give up waiting after SECONDS (exit 4)")
        ] = None,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the job id")] = False,
    ) -> None:
        """Submit a job; print its id and URL. --wait/--follow gate on its outcome."""
        spec = load_spec(spec_file, overrides or [])
        deadline = time.monotonic() + timeout if timeout is not None else None
        with make_client() as client:
            if wait or follow:
                job, retried = _submit_retrying(client, spec, idempotency_key, deadline)
                if retried and deadline is not None:  # the retries' time came out of --timeout
                    timeout = max(0.0, deadline - time.monotonic())
            else:
                job = client.submit(spec, idempotency_key)
            job_id = str(job["id"])
            if quiet:
                typer.echo(clean(job_id))
            else:
                again = "" if job.get("status") == "queued" else f" ({job.get('status')})"
                typer.echo(clean(f"job {job_id} submitted{again}: {client.job_url(job_id)}"))
            if wait or follow:
                raise typer.Exit(
                    wait_for_job(client, job_id, follow=follow, timeout=timeout, quiet=quiet)
                )

    @app.command("plan", epilog=EXIT_CODES_HELP)
    @cli_errors
    def plan(
        spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="job spec, YAML or JSON")],
        overrides: Annotated[
            list[str] | None,
            typer.Option("--set", metavar="KEY.PATH=VALUE", help="override a spec value"),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """Dry run: validate the spec as submit does and print its plan (parameters, memory
        per device by term, whether it fits the queue's devices); nothing is queued."""
        spec = load_spec(spec_file, overrides or [])
        with make_client() as client:
            _show(client.plan(spec), as_json, plan_text)

    @app.command("ls")
    @cli_errors
    def ls(
        status: Annotated[str | None, typer.Option("--status", help="queued, running, ...")] = None,
        label: Annotated[
            list[str] | None, typer.Option("--label", metavar="KEY:VALUE", help="label filter")
        ] = None,
        name: Annotated[str | None, typer.Option("--name", help="job name")] = None,
        limit: Annotated[int, typer.Option("--limit", min=1, max=500)] = 50,
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """List jobs, newest first."""
        with make_client() as client:
            page = client.jobs(status=status, labels=label, name=name, limit=limit)
        _show(page, as_json, lambda p: job_rows(p.get("items", [])))

    @app.command("status")
    @cli_errors
    def status_cmd(
        job_id: Annotated[str, typer.Argument(metavar="ID")],
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """One job: status, reason, attempts, latest metrics, why it waits."""
        with make_client() as client:
            _show(client.job(job_id), as_json, job_status)

    @app.command("logs")
    @cli_errors
    def logs(
        job_id: Annotated[str, typer.Argument(metavar="ID")],
        follow: Annotated[
            bool, typer.Option("--follow", "-f", help="keep printing until the job ends")
        ] = False,
        tail: Annotated[
            int | None, typer.Option("--tail", min=0, help="only the last N lines first")
        ] = None,
    ) -> None:
        """Print a job's log lines (every rank, tagged); -f follows until the job ends."""
        with make_client() as client:
            if not follow:
                sys.stdout.write(client.logs(job_id, tail=tail))
                sys.stdout.flush()
                return
            for text in client.follow_logs(job_id, tail=tail):
                sys.stdout.write(text)
                sys.stdout.flush()

    @app.command("cancel")
    @cli_errors
    def cancel(job_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
        """Cancel a job (idempotent): queued ends at once, running stops within the grace."""
        with make_client() as client:
            job = client.cancel(job_id)
        typer.echo(clean(f"job {job.get('id')} {job.get('status')}"))

    @app.command("rm")
    @cli_errors
    def rm(job_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
        """Delete a finished job with its metrics and logs (a running one: cancel it first)."""
        with make_client() as client:
            client.delete_job(job_id)
        typer.echo(clean(f"job {job_id} deleted"))

    @app.command("metrics")
    @cli_errors
    def metrics(
        job_id: Annotated[str, typer.Argument(metavar="ID")],
        csv: Annotated[bool, typer.Option("--csv", help="CSV, every metric column")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
        max_points: Annotated[int, typer.Option("--max-points", min=1, max=100_000)] = 1000,
    ) -> None:
        """A job's metrics by step (downsampled to --max-points)."""
        with make_client() as client:
            if csv:
                text = client.metrics_csv(job_id, max_points=max_points)
                sys.stdout.write("\n".join(clean(line) for line in text.split("\n")))
                return
            out = client.metrics(job_id, max_points=max_points)
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        rows = [
            [
                str(p["step"]),
                fmt(p.get("loss"), ".4f"),
                fmt(p.get("val_loss"), ".4f"),
                fmt(p.get("lr"), ".2e"),
                fmt(p.get("tokens_per_s"), ",.0f"),
                fmt(p.get("step_time_s"), ".3f"),
            ]
            for p in out.get("points", [])
        ]
        header = ["STEP", "LOSS", "VAL_LOSS", "LR", "TOK/S", "STEP_S"]
        typer.echo(table(rows, header) if rows else "no metrics yet")

    @app.command("workers")
    @cli_errors
    def workers(
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """Live workers: queues, slots, GPUs, running jobs."""
        with make_client() as client:
            out = client.workers()
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        rows = [
            [
                w["name"],
                w.get("host") or "-",
                ",".join(w.get("queues") or []) or "-",
                fmt(w.get("slots")),
                ",".join(map(str, w.get("gpus") or [])) or "-",
                ",".join(w.get("running") or []) or "-",
                f"{w.get('age_s', 0):.0f}s",
            ]
            for w in out.get("items", [])
        ]
        header = ["NAME", "HOST", "QUEUES", "SLOTS", "GPUS", "RUNNING", "SEEN"]
        typer.echo(table(rows, header) if rows else "no live workers")

    @app.command("queues")
    @cli_errors
    def queues(
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """Queues: capacity (workers, free/all slots, slot size), running and queued jobs,
        and who queued them at which priority."""
        with make_client() as client:
            out = client.queues()
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        rows = [
            [
                q["name"],
                fmt(q.get("workers")),
                f"{q.get('free_slots', 0)}/{q.get('slots', 0)}",
                fmt(q.get("largest_slot_procs")),
                fmt(q.get("running")),
                fmt(q.get("queued")),
                ", ".join(
                    f"{g['owner'] or 'others'}@{g['priority']}:{g['jobs']}"
                    for g in q.get("queued_by") or []
                )
                or "-",
            ]
            for q in out.get("items", [])
        ]
        header = ["QUEUE", "WORKERS", "FREE", "SLOT_PROCS", "RUNNING", "QUEUED", "QUEUED_BY"]
        typer.echo(table(rows, header) if rows else "no queues")

    @data_app.command("prepare")
    @cli_errors
    def data_prepare(
        files: Annotated[list[Path], typer.Argument(metavar="FILE...", help="UTF-8 text files")],
        out: Annotated[Path, typer.Option("--out", help="output folder for the shards")],
        val_fraction: Annotated[float, typer.Option("--val-fraction", min=0.0, max=0.99)] = 0.1,
        shard_tokens: Annotated[
            int | None, typer.Option("--shard-tokens", min=1, help="tokens per shard")
        ] = None,
        tokenizer: Annotated[
            Path | None, typer.Option("--tokenizer", help="a Hugging Face tokenizer.json")
        ] = None,
        overwrite: Annotated[
            bool, typer.Option("--overwrite", help="replace shards already in --out")
        ] = False,
    ) -> None:
        """Tokenize text files into llm.c-format train/val shards (byte-level by default)."""
        from trainer.data import DataError
        from trainer.prepare import DEFAULT_SHARD_TOKENS, prepare

        try:
            summary = prepare(
                files,
                out,
                val_fraction=val_fraction,
                shard_tokens=shard_tokens or DEFAULT_SHARD_TOKENS,
                tokenizer=tokenizer,
                overwrite=overwrite,
            )
        except DataError as exc:
            raise fail(str(exc), 1) from None
        typer.echo(summary.line())
