"""Reading what runs reported: a job's metric rows and evenly spaced points, its log chunks
and where a live log follower takes over."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Float, Integer, func, literal_column, select, text
from sqlalchemy.engine import RowMapping
from sqlalchemy.types import TypeEngine

from service.api.core.models import LOGS, METRICS
from service.api.jobs.crud import Reader
from trainer.events import NODE_SEQ_SHIFT

__all__ = ["log_chunks", "log_marks", "metric_points", "metric_rows"]


def metric_rows(session: Reader, job_id: str, since_step: int | None) -> list[RowMapping]:
    stmt = select(METRICS.c.attempt, METRICS.c.step, METRICS.c.ts, METRICS.c.data).where(
        METRICS.c.job_id == job_id
    )
    if since_step is not None:
        stmt = stmt.where(METRICS.c.step >= since_step)
    return list(session.execute(stmt.order_by(METRICS.c.step, METRICS.c.attempt)).mappings())


# Latest attempt per step, then evenly spaced picks, in SQL: only the picked rows (and their
# JSON) leave the database. Row i of n is kept when floor(i*(m-1)/(n-1)) first takes a new
# value, which picks exactly m rows including the first (i = 0) and the last (i = n-1);
# integer division is the same on PostgreSQL and SQLite. The index (job_id, step, attempt)
# serves both windows' order.
_METRIC_POINTS = """
WITH dedup AS (
  SELECT id, step, row_number() OVER (PARTITION BY step ORDER BY attempt DESC) AS dup
  FROM metrics WHERE job_id = :job {since}
), ranked AS (
  SELECT id, step, row_number() OVER (ORDER BY step) - 1 AS i, count(*) OVER () AS n
  FROM dedup WHERE dup = 1
)
SELECT m.attempt, m.step, m.ts, m.data, r.n FROM ranked r JOIN metrics m ON m.id = r.id
WHERE r.n <= :m OR r.i = r.n - 1 OR (:m > 1 AND (r.i = 0 OR
      (r.i * (:m - 1)) / (r.n - 1) > ((r.i - 1) * (:m - 1)) / (r.n - 1)))
ORDER BY r.step
"""
_COLUMNS: dict[str, TypeEngine[Any]] = {
    "attempt": Integer(),
    "step": Integer(),
    "ts": Float(),
    "data": METRICS.c.data.type,
    "n": Integer(),
}
_METRIC_POINTS_ALL = text(_METRIC_POINTS.format(since="")).columns(**_COLUMNS)
_METRIC_POINTS_SINCE = text(_METRIC_POINTS.format(since="AND step >= :since")).columns(**_COLUMNS)


def metric_points(
    session: Reader, job_id: str, since_step: int | None, max_points: int
) -> tuple[list[RowMapping], int]:
    """A job's metric points by step (a resumed attempt's point wins for a step), at most
    ``max_points`` evenly spaced ones keeping the first and the last; (rows, total)."""
    params: dict[str, Any] = {"job": job_id, "m": max_points}
    if since_step is None:
        stmt = _METRIC_POINTS_ALL
    else:
        stmt, params["since"] = _METRIC_POINTS_SINCE, since_step
    rows = list(session.execute(stmt, params).mappings())
    return rows, (int(rows[0]["n"]) if rows else 0)


def log_chunks(
    session: Reader, job_id: str, attempt: int | None, *, newest_first: bool = False
) -> Iterator[RowMapping]:
    """A job's log chunks in order (or newest first, for a tail that stops early)."""
    stmt = select(LOGS.c.attempt, LOGS.c.seq, LOGS.c.lines).where(LOGS.c.job_id == job_id)
    if attempt is not None:
        stmt = stmt.where(LOGS.c.attempt == attempt)
    order = (
        (LOGS.c.attempt.desc(), LOGS.c.seq.desc()) if newest_first else (LOGS.c.attempt, LOGS.c.seq)
    )
    return iter(session.execute(stmt.order_by(*order)).mappings())


def log_marks(session: Reader, job_id: str) -> dict[tuple[int, int], int]:
    """The last log seq stored per (attempt, node): where a follower of the live stream takes
    over. Each node of a multi-node attempt numbers its events in its own range."""
    node = LOGS.c.seq // literal_column(str(1 << NODE_SEQ_SHIFT))  # the same text twice
    rows = session.execute(
        select(LOGS.c.attempt, node, func.max(LOGS.c.seq))
        .where(LOGS.c.job_id == job_id)
        .group_by(LOGS.c.attempt, node)
    )
    return {(int(a), int(n)): int(seq) for a, n, seq in rows}
