"""The ``trainq`` command: database migrations, API tokens, the API server, a worker,
``trainq up`` (``service.local``), and the client commands registered from ``service.cli.commands``.

Each command imports only what it needs (the API server imports no Celery, the token
commands no FastAPI, nothing imports torch), so the CLI starts fast on any host.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from service.cli import artifacts, generate
from service.cli.commands import register
from service.cli.instance import DataDir, admin_errors, instance
from service.local.demo import DEMO_STEPS

if TYPE_CHECKING:
    from service.api.core.settings import Settings

__all__ = ["app", "main"]

app = typer.Typer(
    help="trainq: a job service for distributed PyTorch training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="The SQL store's schema.", no_args_is_help=True)
token_app = typer.Typer(help="API bearer tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


def _settings() -> Settings:
    from service.api.core.settings import Settings

    return Settings()


@db_app.command("upgrade")
@admin_errors
def db_upgrade(
    revision: Annotated[str, typer.Argument()] = "head", data_dir: DataDir = None
) -> None:
    """Apply migrations up to REVISION (default: head); creates the store if it is new."""
    from service.api.core import migrate

    db = instance(data_dir, create=True)
    with db.errors():
        migrate.upgrade(db.url, revision)
        typer.echo(f"database at revision {migrate.current(db.url)}")


@db_app.command("downgrade")
@admin_errors
def db_downgrade(revision: Annotated[str, typer.Argument()], data_dir: DataDir = None) -> None:
    """Revert migrations down to REVISION ("base" removes every table)."""
    from service.api.core import migrate

    db = instance(data_dir)
    with db.errors():
        migrate.downgrade(db.url, revision)
        typer.echo(f"database at revision {migrate.current(db.url)}")


@db_app.command("current")
@admin_errors
def db_current(data_dir: DataDir = None) -> None:
    """Print the database's current revision."""
    from service.api.core import migrate

    db = instance(data_dir)
    with db.errors():
        typer.echo(migrate.current(db.url) or "(empty)")


@token_app.command("create")
@admin_errors
def token_create(
    name: Annotated[str, typer.Option("--name", help="owner of the jobs this token submits")],
    admin: Annotated[bool, typer.Option("--admin", help="sees and cancels every job")] = False,
    data_dir: DataDir = None,
) -> None:
    """Create a token; it is printed once, alone on the last line, and never stored."""
    from service.api.core.auth import create_token

    name = name.strip()
    if not name or len(name) > 128:
        raise typer.BadParameter("a name of 1 to 128 characters", param_hint="--name")
    with instance(data_dir).session(write=True) as session:
        token = create_token(session, name, admin=admin)
    kind = "admin token" if admin else "token"
    typer.echo(f"created {kind} for {name!r}; store it now, it is not shown again:")
    typer.echo(token)


@token_app.command("list")
@admin_errors
def token_list(data_dir: DataDir = None) -> None:
    """List tokens (id, name, admin, created, revoked); never the tokens themselves."""
    from service.api.core.auth import list_tokens

    with instance(data_dir).session() as session:
        rows = list_tokens(session)
    for t in rows:
        revoked = t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else "-"
        typer.echo(
            f"{t.id}\t{t.name}\t{'admin' if t.admin else 'user'}\t"
            f"{t.created_at.isoformat(timespec='seconds')}\trevoked={revoked}"
        )


@token_app.command("revoke")
@admin_errors
def token_revoke(
    name: Annotated[
        str | None, typer.Option("--name", help="revoke every token of this name")
    ] = None,
    token_id: Annotated[int | None, typer.Option("--id", help="revoke one token by id")] = None,
    data_dir: DataDir = None,
) -> None:
    """Revoke tokens by --name or --id (effective within TRAINQ_TOKEN_CACHE_S)."""
    from service.api.core.auth import revoke_tokens

    if (name is None) == (token_id is None):
        raise typer.BadParameter("give exactly one of --name or --id")
    with instance(data_dir).session(write=True) as session:
        n = revoke_tokens(session, name=name, token_id=token_id)
    typer.echo(f"revoked {n} token(s)")
    if n == 0:
        raise typer.Exit(1)


def _limit_values(row: Any) -> list[str]:
    """An owner_limits row's limits as text, "-" where the service's setting applies."""
    from service.api.scheduling.limits import LIMIT_FIELDS

    values = [getattr(row, f) if row is not None else None for f in LIMIT_FIELDS]
    return ["-" if v is None else str(v) for v in values]


@token_app.command("limits")
@admin_errors
def token_limits(
    name: Annotated[str | None, typer.Argument(help="the owner (a token's name)")] = None,
    max_priority: Annotated[
        int | None, typer.Option(help="highest priority its jobs may ask for (may be negative)")
    ] = None,
    max_running: Annotated[
        int | None, typer.Option(help="slots (GPUs) it may hold per queue; 0: no cap")
    ] = None,
    max_queued: Annotated[int | None, typer.Option(help="queued jobs; 0: no limit")] = None,
    submits_per_minute: Annotated[int | None, typer.Option(help="0: no limit")] = None,
    clear: Annotated[
        bool, typer.Option("--clear", help="limits not given go back to the service's settings")
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """Set an owner's limits (only those given change) and print them; with no NAME, list
    every owner's. "-": the service's setting applies (TRAINQ_MAX_PRIORITY, ...). The API
    sees a change within TRAINQ_TOKEN_CACHE_S."""
    from service.api.scheduling.limits import list_limits, set_limits

    values = {
        "max_priority": max_priority,
        "max_running": max_running,
        "max_queued": max_queued,
        "submits_per_minute": submits_per_minute,
    }
    if name is None:
        if clear or any(v is not None for v in values.values()):
            raise typer.BadParameter("give the owner's NAME to set its limits")
    elif not (name := name.strip()) or len(name) > 128:
        raise typer.BadParameter("a name of 1 to 128 characters", param_hint="NAME")
    for field, value in values.items():
        flag = "--" + field.replace("_", "-")
        if field != "max_priority" and value is not None and value < 0:
            raise typer.BadParameter(f"{value} is negative; 0 means no limit", param_hint=flag)
        if value is not None and value > 2**31 - 1:
            raise typer.BadParameter(f"at most {2**31 - 1}", param_hint=flag)
    if max_priority is not None and not -1000 <= max_priority <= 1000:
        raise typer.BadParameter("a priority from -1000 to 1000", param_hint="--max-priority")
    with instance(data_dir).session(write=True) as session:
        if name is None:
            typer.echo("\t".join(["owner", *values]))
            for r in list_limits(session):
                typer.echo("\t".join([r.owner, *_limit_values(r)]))
            return
        shown = _limit_values(set_limits(session, name, clear=clear, **values))
    typer.echo(f"{name}: " + " ".join(f"{f}={v}" for f, v in zip(values, shown, strict=True)))


@token_app.command("tracking")
@admin_errors
def token_tracking(
    name: Annotated[str, typer.Argument(help="the owner (a token's name)")],
    spec: Annotated[
        Path | None,
        typer.Argument(help="a YAML/JSON file of train.tracking (wandb, mlflow)", dir_okay=False),
    ] = None,
    clear: Annotated[bool, typer.Option("--clear", help="remove the owner's default")] = False,
    data_dir: DataDir = None,
) -> None:
    """Set the owner's default train.tracking, for its specs that name none, and print it;
    with neither SPEC nor --clear, print it. Keys never go here: see README's trackers."""
    import json

    from pydantic import ValidationError

    from service.api.scheduling.limits import set_tracking
    from trainer.config import TrackingConfig
    from trainer.yamlspec import SpecSyntaxError, load_yaml

    if not (name := name.strip()) or len(name) > 128:
        raise typer.BadParameter("a name of 1 to 128 characters", param_hint="NAME")
    if spec is not None and clear:
        raise typer.BadParameter("give SPEC or --clear, not both")
    value: dict[str, Any] | None = None
    if spec is not None:
        try:
            raw = load_yaml(spec.read_text(encoding="utf-8"))
            value = TrackingConfig.model_validate(raw).model_dump(mode="json", exclude_none=True)
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {spec}: {exc.strerror}") from None
        except (SpecSyntaxError, ValidationError, ValueError) as exc:
            raise typer.BadParameter(f"{spec} is not a valid train.tracking: {exc}") from None
    with instance(data_dir).session(write=True) as session:
        if spec is None and not clear:
            from service.api.core.models import OwnerLimit

            row = session.get(OwnerLimit, name)
            value = row.tracking if row is not None else None
        else:
            set_tracking(session, name, value)
    typer.echo(f"{name}: tracking={json.dumps(value, sort_keys=True) if value else '-'}")


@app.command("api")
def api(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the REST API (service.api.app:app) with uvicorn."""
    import uvicorn

    from service.api.core.db import ensure_sqlite_dir

    ensure_sqlite_dir(_settings().database_url)
    uvicorn.run("service.api.app:app", host=host, port=port, workers=workers, log_level="info")


@app.command("worker")
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated queues to serve")] = "default",
    slots: Annotated[int, typer.Option(help="attempts run at once")] = 1,
    gpus: Annotated[str | None, typer.Option(help="comma-separated GPU indices")] = None,
    hostname: Annotated[str | None, typer.Option(help="worker name (default: the host's)")] = None,
    advertise_host: Annotated[
        str | None,
        typer.Option(
            help="address other hosts reach this one at (default: TRAINQ_ADVERTISE_HOST, else"
            " the address of the interface that reaches the broker)"
        ),
    ] = None,
) -> None:
    """Run a Celery worker on this host (the worker package; no database access)."""
    from worker.cli import run  # type: ignore[import-not-found,unused-ignore]

    queue_list = [q.strip() for q in queues.split(",") if q.strip()]
    try:
        gpu_list = [int(g) for g in gpus.split(",") if g.strip()] if gpus else None
    except ValueError as exc:
        raise typer.BadParameter("GPU indices are integers, e.g. 0,1", param_hint="--gpus") from exc
    try:
        run(
            queues=queue_list,
            slots=slots,
            gpus=gpu_list,
            hostname=hostname,
            advertise_host=advertise_host,
        )
    except ValueError as exc:  # empty queues, GPUs that do not divide across slots
        typer.echo(f"trainq worker: error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command("up")
def up_cmd(
    host: Annotated[
        str, typer.Option(help="address of the API; not loopback: auth is required")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port of the API")] = 8000,
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="SQLite, Redis, datasets, runs and logs")
    ] = Path(".trainq"),
    demo: Annotated[
        bool, typer.Option("--demo", help="also train a tiny model on a bundled corpus")
    ] = False,
    demo_steps: Annotated[
        int, typer.Option("--demo-steps", min=1, max=100_000, help="steps of the demo job")
    ] = DEMO_STEPS,
) -> None:
    """Run everything on this machine: SQLite, Redis, the API and a worker. Ctrl-C stops it."""
    from service.local.up import up

    raise typer.Exit(up(host, port, data_dir, demo, demo_steps=demo_steps))


# The HTTP client commands (submit, ls, status, logs, cancel, metrics, workers, data) live in
# their own module, which imports only typer, httpx and yaml at this point.
register(app)
artifacts.register(app)  # checkpoints, download
generate.register(app)  # generate


def main() -> None:
    app()
