"""GET /v1/jobs/{id} on PostgreSQL: the answer's JSON built by the database, so the hot read
path parses and re-serializes nothing in Python."""

from __future__ import annotations

from pydantic import BaseModel

from service.api.core.auth import Principal
from service.api.core.db import AsyncReader
from service.api.jobs.schemas import AttemptOut, JobOut, LatestMetrics

__all__ = ["aget_job_json"]

# The JSON of JobOut, field for field in the schema's order, as compact as pydantic writes it
# (datetimes in UTC with "Z", microseconds only when not zero); the stored JSON columns
# (labels, train, the latest metrics' values) are spliced in as stored, not parsed and
# re-serialized: the same values, though a number may be spelled differently (1e-08 where
# pydantic writes 1e-8). Only pending_reason is left to the caller, which needs Redis for
# it: the row holds the text before it (``head``) and after it (``tail``).
# tests/api/test_job_json.py checks this against job_out(), the pydantic answer.


def _json_value(expr: str) -> str:
    return f"coalesce(to_json({expr})::text, 'null')"


def _json_time(expr: str) -> str:
    utc = f"({expr} AT TIME ZONE 'UTC')"
    return (
        f"CASE WHEN {expr} IS NULL THEN 'null' ELSE"
        f" '\"' || to_char({utc}, 'YYYY-MM-DD\"T\"HH24:MI:SS')"
        f" || CASE to_char({utc}, 'US') WHEN '000000' THEN '' ELSE '.' || to_char({utc}, 'US') END"
        " || 'Z\"' END"
    )


def _json_members(fields: list[tuple[str, str]], first: bool) -> str:
    """SQL concatenating ``"name":value`` pairs (values are SQL expressions of JSON text)."""
    pieces = []
    for i, (name, value) in enumerate(fields):
        sep = "{" if first and i == 0 else ","
        pieces.append(f"'{sep}\"{name}\":' || {value}")
    return " || ".join(pieces)


def _schema_members(
    model: type[BaseModel], alias: str, special: dict[str, str]
) -> list[tuple[str, str]]:
    members = []
    for name in model.model_fields:
        if name in special:
            members.append((name, special[name]))
        elif name.endswith("_at"):
            members.append((name, _json_time(f"{alias}.{name}")))
        else:
            members.append((name, _json_value(f"{alias}.{name}")))
    return members


_LATEST = (
    "CASE WHEN json_typeof(j.last_metrics) = 'object' THEN "
    + _json_members(
        [
            (n, f"coalesce((j.last_metrics -> '{n}')::text, 'null')")
            for n in LatestMetrics.model_fields
        ],
        first=True,
    )
    + " || '}' ELSE 'null' END"
)
_ATTEMPTS = (
    "'[' || coalesce((SELECT string_agg("
    + _json_members(_schema_members(AttemptOut, "a", {}), first=True)
    + " || '}', ',' ORDER BY a.number) FROM attempts a WHERE a.job_id = j.id), '') || ']'"
)
_JOB_MEMBERS = _schema_members(
    JobOut,
    "j",
    {
        "labels": "j.labels::text",
        "train": "j.train::text",
        "latest": _LATEST,
        "pending_reason": "",
        "attempts": _ATTEMPTS,
    },
)
_SPLIT = [name for name, _ in _JOB_MEMBERS].index("pending_reason")
_SQL_JOB_JSON = (
    "SELECT j.id, j.owner, j.status, j.queue, "
    + _json_members(_JOB_MEMBERS[:_SPLIT], first=True)
    + " || ',\"pending_reason\":' AS head, "
    + (_json_members(_JOB_MEMBERS[_SPLIT + 1 :], first=False) + " || '}'")
    + " AS tail FROM jobs j WHERE j.id = ANY(%(keys)s)"
)


async def aget_job_json(
    reader: AsyncReader, principal: Principal, job_id: str
) -> tuple[str, str, str, str] | None:
    """(status, queue, head, tail) of a job the principal may see, or None; concurrent
    requests' reads share one statement (``AsyncReader.fetch_keyed``)."""
    row = await reader.fetch_keyed(_SQL_JOB_JSON, job_id)
    if row is None or not principal.can_see(row[1]):
        return None
    return row[2], row[3], row[4], row[5]
