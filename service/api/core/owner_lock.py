"""A lock per owner that holds across API replicas: one row per owner in a lock table
(``dataset_owners`` for dataset quotas, ``job_owners`` for the runs' room and the count of
webhooks), upserted first in the transaction, so the row lock (PostgreSQL) or the write lock
(SQLite) is held to the commit and that owner's checks run one after another.
"""

from __future__ import annotations

from sqlalchemy import Table, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.api.core.models import utcnow

__all__ = ["lock_owner"]


def lock_owner(session: Session, table: Table, owner: str) -> None:
    """Lock the owner's row of ``table`` (columns ``owner``, ``locked_at``) till the
    transaction ends, inserting it on first use. Call it first in the transaction: on SQLite
    a write first takes the database's write lock before anything was read."""
    now = utcnow()
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        upsert = pg_insert if dialect == "postgresql" else sqlite_insert
        stmt = upsert(table).values(owner=owner, locked_at=now)
        session.execute(
            stmt.on_conflict_do_update(index_elements=["owner"], set_={"locked_at": now})
        )
        return
    touch = update(table).where(table.c.owner == owner)
    if session.execute(touch.values(locked_at=now)).rowcount:  # type: ignore[attr-defined]
        return
    try:
        with session.begin_nested():
            session.execute(table.insert().values(owner=owner, locked_at=now))
    except IntegrityError:  # inserted meanwhile: lock it
        session.execute(touch.values(locked_at=now))
