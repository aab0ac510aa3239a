"""The ``trainq`` command: database migrations, API tokens, the API server, a worker
(and, registered from ``service.cli_client`` and ``service.up``, the client commands and
``trainq up``).

Each command imports only what it needs (the API server imports no Celery, the token
commands no FastAPI, nothing imports torch), so the CLI starts fast on any host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from service.settings import Settings

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
    from service.settings import Settings

    return Settings()


def _sessions() -> sessionmaker[Session]:
    from service.db import make_engine, make_sessionmaker

    settings = _settings()
    return make_sessionmaker(make_engine(settings))


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply migrations up to REVISION (default: head)."""
    from service import migrate

    url = _settings().database_url
    migrate.upgrade(url, revision)
    typer.echo(f"database at revision {migrate.current(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()]) -> None:
    """Revert migrations down to REVISION ("base" removes every table)."""
    from service import migrate

    url = _settings().database_url
    migrate.downgrade(url, revision)
    typer.echo(f"database at revision {migrate.current(url)}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's current revision."""
    from service import migrate

    typer.echo(migrate.current(_settings().database_url) or "(empty)")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option("--name", help="owner of the jobs this token submits")],
    admin: Annotated[bool, typer.Option("--admin", help="sees and cancels every job")] = False,
) -> None:
    """Create a token; it is printed once, alone on the last line, and never stored."""
    from service.auth import create_token

    name = name.strip()
    if not name or len(name) > 128:
        raise typer.BadParameter("a name of 1 to 128 characters", param_hint="--name")
    with _sessions()() as session, session.begin():
        token = create_token(session, name, admin=admin)
    kind = "admin token" if admin else "token"
    typer.echo(f"created {kind} for {name!r}; store it now, it is not shown again:")
    typer.echo(token)


@token_app.command("list")
def token_list() -> None:
    """List tokens (id, name, admin, created, revoked); never the tokens themselves."""
    from service.auth import list_tokens

    with _sessions()() as session:
        rows = list_tokens(session)
    for t in rows:
        revoked = t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else "-"
        typer.echo(
            f"{t.id}\t{t.name}\t{'admin' if t.admin else 'user'}\t"
            f"{t.created_at.isoformat(timespec='seconds')}\trevoked={revoked}"
        )


@token_app.command("revoke")
def token_revoke(
    name: Annotated[
        str | None, typer.Option("--name", help="revoke every token of this name")
    ] = None,
    token_id: Annotated[int | None, typer.Option("--id", help="revoke one token by id")] = None,
) -> None:
    """Revoke tokens by --name or --id (effective within TRAINQ_TOKEN_CACHE_S)."""
    from service.auth import revoke_tokens

    if (name is None) == (token_id is None):
        raise typer.BadParameter("give exactly one of --name or --id")
    with _sessions()() as session, session.begin():
        n = revoke_tokens(session, name=name, token_id=token_id)
    typer.echo(f"revoked {n} token(s)")
    if n == 0:
        raise typer.Exit(1)


@app.command("api")
def api(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the REST API (service.app:app) with uvicorn."""
    import uvicorn

    from service.db import ensure_sqlite_dir

    ensure_sqlite_dir(_settings().database_url)
    uvicorn.run("service.app:app", host=host, port=port, workers=workers, log_level="info")


@app.command("worker")
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated queues to serve")] = "default",
    slots: Annotated[int, typer.Option(help="attempts run at once")] = 1,
    gpus: Annotated[str | None, typer.Option(help="comma-separated GPU indices")] = None,
    hostname: Annotated[str | None, typer.Option(help="worker name (default: the host's)")] = None,
) -> None:
    """Run a Celery worker on this host (the worker package; no database access)."""
    from worker.cli import run  # type: ignore[import-not-found,unused-ignore]

    queue_list = [q.strip() for q in queues.split(",") if q.strip()]
    try:
        gpu_list = [int(g) for g in gpus.split(",") if g.strip()] if gpus else None
    except ValueError as exc:
        raise typer.BadParameter("GPU indices are integers, e.g. 0,1", param_hint="--gpus") from exc
    try:
        run(queues=queue_list, slots=slots, gpus=gpu_list, hostname=hostname)
    except ValueError as exc:  # empty queues, GPUs that do not divide across slots
        typer.echo(f"trainq worker: error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _register_others() -> None:
    # The HTTP client commands (submit, ls, status, logs, cancel, metrics, workers, data) and
    # `trainq up` live in their own modules; both import only typer at this point.
    from service.cli_client import register
    from service.up import register_up

    register(app)
    register_up(app)


_register_others()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
