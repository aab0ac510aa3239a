"""An owner's room for datasets (``TRAINQ_DATASET_MAX_OWNER_BYTES``), held under concurrency.

Each dataset row counts ``disk_bytes`` against its owner's limit; the owner's usage is the
sum over their datasets that have not failed (a failed one's files are gone; a deleted one's
row too), so a failure or a delete releases what it held with no bookkeeping of its own.

- **Admission** (``begin_upload``) reserves a bound on the prepared folder's size of the
  declared ``Content-Length`` (:func:`prepared_bound`: up to 2 bytes a token, a token a
  byte for text and jsonl, the shards' own tokens for bin, plus headers, ``meta.json`` and a
  copied tokenizer). An upload without a length reserves as its bytes arrive: before each
  buffer is written, the reservation is raised to cover what came (:func:`reserve`).
- **Once prepared** the reservation becomes the folder's real size (:func:`settle`): what
  lands on disk is what counts, not the upload. A folder larger than the room left (a
  tokenizer whose tokens outnumber the bytes) fails the dataset, naming the setting.

Every step reads the usage and writes its row in one transaction that first locks the
owner's ``dataset_owners`` row (an upsert: PostgreSQL's row lock, SQLite's write lock, held
to the commit), so uploads of one owner through any number of API replicas are checked one
after another and their sum never passes the limit. The limit is read at each step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.api.core import owner_lock
from service.api.core.errors import PayloadTooLarge
from service.api.core.models import DATASET_OWNERS, DATASETS, utcnow

__all__ = [
    "SETTING",
    "check",
    "folder_bytes",
    "lock_owner",
    "prepared_bound",
    "reserve",
    "settle",
    "used",
]

SETTING = "TRAINQ_DATASET_MAX_OWNER_BYTES"
# trainer.prepare's shard layout (DEFAULT_SHARD_TOKENS, trainer.data.HEADER_BYTES), named
# here so the API does not import numpy to size a reservation.
SHARD_TOKENS = 100_000_000
HEADER_BYTES = 256 * 4
# meta.json and the folder's other small files.
META_BYTES = 64 * 1024


def prepared_bound(fmt: str, received: int, tokenizer_bytes: int = 0) -> int:
    """At most what the prepared folder of an upload of ``received`` bytes holds: its
    tokens at 2 bytes each (text and jsonl: at most one a byte; bin: the shards' own), a
    header per shard (train and val each end with a partial one), ``meta.json``, and the
    copied ``tokenizer.json`` (``tokenizer_bytes``); chat and completion: see below."""
    tokens = received // 2 if fmt == "bin" else received
    per_token, files = 2, 1
    if fmt in ("chat", "completion"):
        # A template adds its markers (ChatML's take about what the shortest JSON message
        # spends on its keys): twice the bytes; and each token has a mask byte beside its
        # two, in a mask shard per token shard, and tokenizer_config.json comes along. A
        # template wordier than that is caught when the folder settles (its real size).
        tokens, per_token, files = 2 * tokens, 3, 2
    shards = tokens // SHARD_TOKENS + 2
    return per_token * tokens + files * (shards * HEADER_BYTES + META_BYTES) + tokenizer_bytes


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (links not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if not p.is_dir())


def lock_owner(session: Session, owner: str) -> None:
    """Lock the owner's ``dataset_owners`` row till the transaction ends (first in it)."""
    owner_lock.lock_owner(session, DATASET_OWNERS, owner)


def used(session: Session, owner: str, exclude: str | None = None) -> int:
    """What the owner's datasets that have not failed count (``exclude``: but that one)."""
    stmt = select(func.coalesce(func.sum(DATASETS.c.disk_bytes), 0)).where(
        DATASETS.c.owner == owner, DATASETS.c.status != "failed"
    )
    if exclude is not None:
        stmt = stmt.where(DATASETS.c.id != exclude)
    return int(session.execute(stmt).scalar_one())


def too_large(others: int, amount: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"your datasets would hold {others + amount} bytes ({others} already, and up to"
        f" {amount} for this one once prepared, at 2 bytes a token), over the per-owner"
        f" limit of {limit} bytes ({SETTING})"
    )


def check(session: Session, owner: str, amount: int, limit: int, exclude: str | None) -> None:
    """PayloadTooLarge unless ``amount`` more fits beside the rest (the owner locked)."""
    others = used(session, owner, exclude)
    if others + amount > limit:
        raise too_large(others, amount, limit)


def reserve(
    sessions: sessionmaker[Session], dataset_id: str, owner: str, amount: int, limit: int
) -> None:
    """Raise an uploading dataset's reservation to ``amount`` bytes, or PayloadTooLarge
    (its earlier reservation stands until the upload is discarded)."""
    with sessions() as session, session.begin():
        lock_owner(session, owner)
        check(session, owner, amount, limit, exclude=dataset_id)
        session.execute(
            update(DATASETS)
            .where(DATASETS.c.id == dataset_id, DATASETS.c.status == "uploading")
            .values(disk_bytes=amount)
        )


def settle(
    sessions: sessionmaker[Session],
    dataset_id: str,
    owner: str,
    real: int,
    limit: int,
    values: dict[str, Any],
) -> str | None:
    """A prepared dataset counts its folder's ``real`` size: ``preparing`` becomes ready
    (with ``values``); None if done, else why not (the row moved on, or the folder does not
    fit: then the dataset is failed with that reason)."""
    with sessions() as session, session.begin():
        lock_owner(session, owner)
        others = used(session, owner, exclude=dataset_id)
        now = utcnow()
        where = update(DATASETS).where(
            DATASETS.c.id == dataset_id, DATASETS.c.status == "preparing"
        )
        if others + real > limit:
            why = (
                f"the prepared dataset holds {real} bytes; with your other datasets'"
                f" {others} that passes the per-owner limit of {limit} bytes ({SETTING})"
            )
            done = session.execute(
                where.values(status="failed", reason=why, disk_bytes=0, updated_at=now)
            )
            return why if done.rowcount else "moved on"  # type: ignore[attr-defined]
        done = session.execute(where.values(disk_bytes=real, updated_at=now, **values))
        return None if done.rowcount else "moved on"  # type: ignore[attr-defined]
