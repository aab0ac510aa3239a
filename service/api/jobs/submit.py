"""Submitting a job: commit its row, then hand its first attempt to the broker.

Committed first, sent second (design.md): a send that fails leaves the attempt's ``sent_at``
null and the reconciler sends it later; a duplicate send is harmless (the worker claims each
attempt with ``SET NX``). A request is answered only once its row is committed.

On PostgreSQL, submits that arrive together are committed together (``GroupCommit``): one
INSERT of all their rows, so one commit and one WAL flush for all; one pipelined write of
their messages to the broker; one UPDATE of their ``sent_at``. Each request waits for its
own batch, and is answered after the batch's commit and send. A row the batch does not take
(an Idempotency-Key its owner used before, a value the database refuses) is submitted alone
by ``submit_one``, as every submit is on SQLite, so it succeeds or fails alone; so is a
submit under its owner's bound on the runs (``service.api.jobs.room``: it locks its owner).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Protocol

from sqlalchemy import Engine, bindparam, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.api.core.auth import Principal
from service.api.core.db import AsyncReader, PerLoop
from service.api.core.models import ATTEMPTS, utcnow
from service.api.jobs import crud
from service.api.jobs.schemas import JobSpec
from service.api.scheduling.dispatch import Dispatcher

__all__ = ["GroupCommit", "Store", "submit_one"]

log = logging.getLogger(__name__)

_MARK_SENT = (
    update(ATTEMPTS)
    .where(ATTEMPTS.c.job_id == bindparam("job"), ATTEMPTS.c.number == 1)
    .values(sent_at=bindparam("sent"))
)


class Store(Protocol):
    """What a submit needs of the process's services (``deps.Services`` is one). A protocol,
    not an import: ``deps`` builds on this module, so this module must not import ``deps``."""

    engine: Engine
    sessions: sessionmaker[Session]
    reader: Engine
    areader: AsyncReader | None
    dispatcher: Dispatcher


def submit_one(
    services: Store,
    principal: Principal,
    spec: JobSpec,
    key: str | None,
    *,
    disk_bytes: int = 0,
    room: int = 0,
) -> tuple[dict[str, Any], bool]:
    """Commit one job (or find the one its Idempotency-Key made), send it; (row, created).
    ``disk_bytes``: its run folder's worst case; ``room``: what its owner's runs may hold
    together (0: no bound), checked in the transaction that inserts it (service.api.jobs.room)."""
    postgres = services.areader is not None
    if postgres and not room:
        with services.reader.connect() as conn:  # autocommit: one statement, one round trip
            row, created = crud.create_job(conn, principal, spec, key, disk_bytes=disk_bytes)
    else:
        with services.sessions() as session:
            row, created = crud.create_job(
                session, principal, spec, key, disk_bytes=disk_bytes, room=room
            )
    # Committed first, sent second: a failed send leaves it for the reconciler.
    dispatcher = services.dispatcher
    if created and dispatcher.admits:
        dispatcher.wake()  # the admitter places and sends it (service.api.scheduling.admit)
    elif created and not dispatcher.backing_off and dispatcher.send_attempt(row, 1):
        if postgres:
            with services.reader.connect() as conn:
                conn.connection.driver_connection.execute(  # type: ignore[union-attr]
                    _mark_sent_sql([row["id"]])
                )
        else:
            with services.engine.begin() as conn:
                conn.execute(_MARK_SENT, {"job": row["id"], "sent": utcnow()})
    return row, created


_HEX_ID = re.compile(r"[0-9a-f]{1,32}")


def _mark_sent_sql(job_ids: list[str]) -> str:
    """sent_at in one round trip, without waiting for the WAL flush: a sent_at lost in a
    crash only means the reconciler sends again, which the worker's SET NX claim makes
    harmless. Several statements go in one simple query, which takes no parameters; the
    ids are ones this process generated, checked to be hex before they are written in."""
    for job_id in job_ids:
        if not _HEX_ID.fullmatch(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
    ids = ", ".join(f"'{job_id}'" for job_id in job_ids)
    return (
        "BEGIN; SET LOCAL synchronous_commit = off;"
        f" UPDATE attempts SET sent_at = now() WHERE job_id IN ({ids}) AND number = 1;"
        " COMMIT"
    )


class _Waiting:
    """One event loop's submits waiting for a batch, and its batches under way."""

    def __init__(self, loop: asyncio.AbstractEventLoop, in_flight: int) -> None:
        self.loop = loop
        self.rows: list[tuple[dict[str, Any], asyncio.Future[bool]]] = []
        self.slots = asyncio.Semaphore(in_flight)


class GroupCommit:
    """Group commit of concurrent submits (PostgreSQL), per event loop."""

    MAX_ROWS = 500  # per statement
    IN_FLIGHT = 4  # batches under way at once; more submits wait and share the next one

    def __init__(self, reader: AsyncReader, dispatcher: Dispatcher) -> None:
        self.reader = reader
        self.dispatcher = dispatcher
        self._waiting = PerLoop(lambda loop: _Waiting(loop, self.IN_FLIGHT))

    def _here(self) -> _Waiting:
        return self._waiting.get()

    async def add(self, row: dict[str, Any]) -> bool:
        """True once ``row`` (a ``crud.job_row``) is committed and its attempt sent, or left
        unsent for the reconciler; False if the batch did not take it (``submit_one`` then)."""
        waiting = self._here()
        future: asyncio.Future[bool] = waiting.loop.create_future()
        waiting.rows.append((row, future))
        if len(waiting.rows) == 1:  # the first of the next batch starts it
            waiting.loop.create_task(self._batch(waiting))
        # Shielded: a client that goes away must not cancel its row's part of the batch.
        return await asyncio.shield(future)

    async def _batch(self, waiting: _Waiting) -> None:
        async with waiting.slots:  # meanwhile, later submits join this batch
            batch = waiting.rows[: self.MAX_ROWS]
            waiting.rows = waiting.rows[self.MAX_ROWS :]
            if waiting.rows:
                waiting.loop.create_task(self._batch(waiting))
            try:
                inserted = await crud.acreate_jobs(self.reader, [row for row, _ in batch])
            except Exception as err:
                import psycopg

                alone = isinstance(err, psycopg.Error)  # not an outage: a value it refused
                for _, future in batch:
                    if future.done():
                        continue
                    if alone:
                        future.set_result(False)
                    else:
                        future.set_exception(err)
                return
            committed = [row for row, _ in batch if row["id"] in inserted]
            try:
                if committed and self.dispatcher.admits:
                    await run_in_threadpool(self.dispatcher.wake)
                elif committed and not self.dispatcher.backing_off:
                    await self._send(committed)
            finally:  # committed whatever happened to the send: the reconciler has the rest
                for row, future in batch:
                    if not future.done():
                        future.set_result(row["id"] in inserted)

    async def _send(self, rows: list[dict[str, Any]]) -> None:
        count = await run_in_threadpool(self.dispatcher.send_batch, rows, 1)
        if count:
            try:
                await self.reader.fetch(_mark_sent_sql([row["id"] for row in rows[:count]]), None)
            except Exception as err:  # committed and sent all the same; the reconciler resends
                log.warning("marking %d attempts sent failed: %s", count, err)
