"""The SQL engine and sessions: one engine per process, SQLite or PostgreSQL by URL.

A pooled PostgreSQL connection whose server went away (restart, failover, a cut network) is
noticed at checkout without a round trip: an idle connection's socket has nothing to read
unless the server closed it or sent its goodbye, so a readable socket means "discard and
connect anew". That keeps the API recovering by itself after an outage at no cost per
request; ``TRAINQ_DB_PRE_PING`` adds SQLAlchemy's full ping (one more round trip) on top.

On PostgreSQL the hot GET routes read through ``AsyncReader``: autocommit psycopg
``AsyncConnection``s used straight from the event loop (no thread-pool hop, no SQLAlchemy
execution layer; statements are compiled once by SQLAlchemy and prepared by psycopg), with
the same readable-socket check at checkout.

SQLite is the embedded store: WAL so readers never block the one writer, a busy timeout so a
second writer waits instead of failing, and foreign keys on (SQLite leaves them off unless
asked on every connection).
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ClauseElement

from service.api.core.settings import Settings

__all__ = [
    "AsyncReader",
    "PerLoop",
    "ensure_sqlite_dir",
    "insert_for",
    "is_sqlite",
    "make_async_reader",
    "make_engine",
    "make_sessionmaker",
    "pg_sql",
]


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def insert_for(conn: Session | Any) -> Any:
    """``insert`` of the store's dialect, the one with ``on_conflict_do_*`` (PostgreSQL's or
    SQLite's, the two the service runs on), for a Session or a Connection."""
    bind = conn.get_bind() if isinstance(conn, Session) else conn
    return (postgresql if bind.dialect.name == "postgresql" else sqlite).insert


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


def pg_sql(stmt: ClauseElement) -> str:
    """A Core statement as PostgreSQL text with ``%(name)s`` parameters (compile once)."""
    return str(stmt.compile(dialect=postgresql.psycopg.dialect()))


T = TypeVar("T")


class PerLoop(Generic[T]):
    """One ``T`` per running event loop, made on first use on that loop. A closed loop's
    ``T`` is dropped (``on_drop``) when a new loop first asks."""

    def __init__(
        self,
        make: Callable[[asyncio.AbstractEventLoop], T],
        on_drop: Callable[[T], None] | None = None,
    ) -> None:
        self._make = make
        self._on_drop = on_drop
        self._items: dict[int, tuple[asyncio.AbstractEventLoop, T]] = {}

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        entry = self._items.get(id(loop))
        if entry is None or entry[0] is not loop:
            for key, (old, item) in list(self._items.items()):
                if old.is_closed():
                    if self._on_drop is not None:
                        self._on_drop(item)
                    del self._items[key]
            entry = self._items[id(loop)] = (loop, self._make(loop))
        return entry[1]

    def values(self) -> list[T]:
        return [item for _, item in self._items.values()]

    def clear(self) -> None:
        self._items.clear()


class _LoopPool:
    def __init__(self, loop: asyncio.AbstractEventLoop, size: int, batches: int) -> None:
        self.loop = loop
        self.idle: list[Any] = []
        self.slots = asyncio.Semaphore(size)
        # fetch_keyed: the keys waiting for the next statement, per statement, and how many
        # of those statements may be at the database at once.
        self.waiting: dict[str, dict[str, asyncio.Future[Any]]] = {}
        self.batch_slots = asyncio.Semaphore(batches)


class AsyncReader:
    """A small pool of autocommit psycopg ``AsyncConnection``s for reads on the event loop.

    Connections belong to the event loop that opened them (a test may run the app on more
    than one loop in turn); a failure to connect or a broken connection is raised as
    SQLAlchemy's ``OperationalError``, so the app's handler answers 503 as for the engine.

    ``fetch_keyed`` coalesces: the reads of one statement that concurrent requests ask for
    while a batch is on its way go to the database together, as one statement over an array
    of keys. Each request still reads after it arrived (its key is sent after it asked), so
    nothing is served from before the request; a busy loop pays one round trip for many.
    """

    def __init__(self, url: str, *, size: int, timeout_s: float, batches: int = 4) -> None:
        import psycopg
        from psycopg.rows import dict_row, tuple_row

        self._psycopg = psycopg
        self._row_factory = dict_row
        self._tuple_row = tuple_row
        self.conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
        self.size = size
        self.batches = min(batches, size)
        self.timeout_s = timeout_s
        self._pools = PerLoop(
            lambda loop: _LoopPool(loop, self.size, self.batches),
            lambda old: self._finish(old.idle),
        )

    def _pool(self) -> _LoopPool:
        return self._pools.get()

    @staticmethod
    def _finish(conns: list[Any]) -> None:
        for conn in conns:
            conn.pgconn.finish()  # synchronous, and what AsyncConnection.close() does
        conns.clear()

    def _take(self, pool: _LoopPool) -> Any:
        while pool.idle:
            conn = pool.idle.pop()
            try:
                readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
            except (OSError, ValueError, self._psycopg.Error):
                readable = [True]
            if not readable and not conn.closed:
                return conn
            conn.pgconn.finish()  # the server closed it (restart, failover): connect anew
        return None

    async def fetch(
        self, sql: str, params: Mapping[str, Any] | None, *, tuples: bool = False
    ) -> list[Any]:
        """Rows of one statement, as dicts by column label (or tuples); one round trip.
        Without ``params``, ``sql`` may be several statements (the simple query protocol);
        what returns no rows returns ``[]``. Autocommit: a write is committed on return."""
        psycopg = self._psycopg
        pool = self._pool()
        # All in use: wait, but not forever (a timer costs, so only here).
        if pool.slots.locked():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await pool.slots.acquire()
            except TimeoutError as err:
                raise exc.TimeoutError("no database connection free in time") from err
        else:
            await pool.slots.acquire()
        conn = None
        try:
            conn = self._take(pool)
            if conn is None:
                async with asyncio.timeout(self.timeout_s):
                    conn = await psycopg.AsyncConnection.connect(
                        self.conninfo,
                        autocommit=True,
                        row_factory=self._row_factory,
                        connect_timeout=max(1, int(self.timeout_s)),
                    )
            cur = conn.cursor(row_factory=self._tuple_row) if tuples else conn.cursor()
            await cur.execute(sql, params)
            rows: list[Any] = await cur.fetchall() if cur.description is not None else []
        except BaseException as err:
            if conn is not None:
                conn.pgconn.finish()  # its state is unknown: never reuse it
            if isinstance(err, psycopg.OperationalError | psycopg.InterfaceError | TimeoutError):
                raise exc.OperationalError(sql, dict(params or {}), err) from err
            raise
        else:
            pool.idle.append(conn)
            return rows
        finally:
            pool.slots.release()

    async def fetch_keyed(self, sql: str, key: str) -> tuple[Any, ...] | None:
        """The row of ``sql`` whose first column is ``key``, or None; coalesced with the other
        keys asked for meanwhile (``sql`` reads the text array ``%(keys)s``)."""
        pool = self._pool()
        waiting = pool.waiting.get(sql)
        if waiting is None:
            waiting = pool.waiting[sql] = {}
            pool.loop.create_task(self._fetch_batch(pool, sql))
        future = waiting.get(key)
        if future is None:
            future = waiting[key] = pool.loop.create_future()
        # Shielded: a request that goes away must not cancel the future others share.
        row: tuple[Any, ...] | None = await asyncio.shield(future)
        return row

    async def _fetch_batch(self, pool: _LoopPool, sql: str) -> None:
        # Started by the first key; it waits its turn (and one loop tick, as a new task),
        # gathering the keys that arrive meanwhile, then takes them all.
        async with pool.batch_slots:
            waiting = pool.waiting.pop(sql)
            try:
                rows = await self.fetch(sql, {"keys": list(waiting)}, tuples=True)
            except BaseException as err:
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(err)
                if not isinstance(err, Exception):
                    raise
                return
        found = {row[0]: row for row in rows}
        for key, future in waiting.items():
            if not future.done():
                future.set_result(found.get(key))

    def close(self) -> None:
        for pool in self._pools.values():
            self._finish(pool.idle)
        self._pools.clear()


def make_async_reader(settings: Settings) -> AsyncReader | None:
    """The event-loop reader on PostgreSQL; None elsewhere (SQLite reads stay on threads)."""
    if make_url(settings.database_url).get_backend_name() != "postgresql":
        return None
    return AsyncReader(
        settings.database_url, size=settings.db_pool_size, timeout_s=settings.db_timeout_s
    )
