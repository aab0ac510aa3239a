"""The SQL engine and sessions: one engine per process, SQLite or PostgreSQL by URL.

A pooled PostgreSQL connection whose server went away (restart, failover, a cut network) is
noticed at checkout without a round trip: an idle connection's socket has nothing to read
unless the server closed it or sent its goodbye, so a readable socket means "discard and
connect anew". That keeps the API recovering by itself after an outage at no cost per
request; ``TRAINQ_DB_PRE_PING`` adds SQLAlchemy's full ping (one more round trip) on top.

SQLite is the embedded store: WAL so readers never block the one writer, a busy timeout so a
second writer waits instead of failing, and foreign keys on (SQLite leaves them off unless
asked on every connection).
"""

from __future__ import annotations

import select
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings

__all__ = ["ensure_sqlite_dir", "is_sqlite", "make_engine", "make_sessionmaker"]


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def ensure_sqlite_dir(url: str) -> None:
    """Create the folder of a file-backed SQLite database (the embedded default)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def make_engine(settings: Settings, url: str | None = None, *, autocommit: bool = False) -> Engine:
    """The process's engine; ``autocommit`` builds the read engine, whose every statement is
    one round trip (no BEGIN, no ROLLBACK on return) for the hot GET paths."""
    url = url or settings.database_url
    kwargs: dict[str, Any] = {"pool_pre_ping": settings.db_pre_ping}
    if autocommit:
        kwargs["isolation_level"] = "AUTOCOMMIT"
    if is_sqlite(url):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": settings.db_timeout_s}
    else:
        kwargs.update(
            pool_size=settings.db_pool_size,
            max_overflow=settings.db_max_overflow,
            pool_timeout=settings.db_timeout_s,
        )
        if make_url(url).get_backend_name() == "postgresql":
            kwargs["connect_args"] = {"connect_timeout": max(1, int(settings.db_timeout_s))}
    engine = create_engine(url, **kwargs)
    if not is_sqlite(url):
        event.listen(engine, "checkout", _discard_if_closed_by_server)
    if is_sqlite(url):
        busy_ms = int(settings.db_timeout_s * 1000)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

    return engine


def _discard_if_closed_by_server(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    fileno = getattr(dbapi_conn, "fileno", None)
    if fileno is None:
        return
    try:
        readable, _, _ = select.select([fileno()], [], [], 0)
    except (OSError, ValueError) as err:  # already closed
        raise exc.DisconnectionError("connection is closed") from err
    if readable:
        # The pool drops this connection and checks out (or opens) another.
        raise exc.DisconnectionError("the server closed this pooled connection")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # Objects stay readable after commit: routes build the response from them afterwards.
    return sessionmaker(engine, expire_on_commit=False)
