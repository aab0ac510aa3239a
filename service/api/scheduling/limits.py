"""What one owner may do: the limits an admin sets per owner (``trainq token limits``) over
the service's settings, and the per-job runtime rules a submit applies.

An owner is a token's name. Its row in ``owner_limits`` overrides the settings column by
column (a null column: the setting applies); a 0 means "no limit", as in the settings, so an
admin can lift one owner's limit below a tighter default. ``max_priority`` is the exception:
any value is a limit (it may be negative), and admin principals have none.

A submit reads its owner's limits through ``OwnerLimitsCache`` (one query per owner per
``token_cache_s``, like ``service.api.core.auth.TokenCache``), so a change takes effect within
that time, as a revoked token does. The admitter reads every owner's running cap at once
(``running_caps``): there are few owners, and it needs them all each pass.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, delete, select
from sqlalchemy.orm import Session

from service.api.core.errors import Forbidden, InvalidInput
from service.api.core.models import OWNER_LIMITS, OwnerLimit, utcnow
from service.api.core.ttlcache import TtlCache

if TYPE_CHECKING:
    from service.api.core.auth import Principal
    from service.api.core.settings import Settings
    from service.api.jobs.schemas import JobSpec

__all__ = [
    "LIMIT_FIELDS",
    "OwnerLimits",
    "OwnerLimitsCache",
    "apply_runtime_rules",
    "check_priority",
    "check_run_disk",
    "clear_limits",
    "list_limits",
    "mib",
    "running_caps",
    "set_limits",
    "set_tracking",
]

# Each limit and the setting that holds its default.
LIMIT_FIELDS: dict[str, str] = {
    "max_priority": "max_priority",
    "max_running": "max_running_per_owner",
    "max_queued": "max_queued_per_owner",
    "submits_per_minute": "submits_per_minute",
}


@dataclass(frozen=True)
class OwnerLimits:
    """One owner's limits, settings merged in. 0: no limit (but for ``max_priority``);
    ``own`` names the fields the owner's row set (for messages that say where a limit is)."""

    max_priority: int
    max_running: int  # slots (GPUs on GPU queues) per queue
    max_queued: int
    submits_per_minute: int
    own: frozenset[str] = frozenset()
    # The owner's default train.tracking as JSON text (``trainq token tracking``), or None.
    tracking: str | None = None

    @classmethod
    def merged(cls, settings: Settings, row: Any | None = None) -> OwnerLimits:
        values = {f: getattr(settings, s) for f, s in LIMIT_FIELDS.items()}
        own = set()
        tracking = None
        if row is not None:
            for f in LIMIT_FIELDS:
                value = getattr(row, f)
                if value is not None:
                    values[f] = int(value)
                    own.add(f)
            if getattr(row, "tracking", None) is not None:
                tracking = json.dumps(row.tracking, sort_keys=True)
        return cls(**values, own=frozenset(own), tracking=tracking)

    def source(self, field: str) -> str:
        """Where the limit ``field`` comes from, for a refusal's message."""
        if field in self.own:
            return f"{field}={getattr(self, field)} set for this owner with `trainq token limits`"
        return f"TRAINQ_{LIMIT_FIELDS[field].upper()}={getattr(self, field)}"


class OwnerLimitsCache:
    """Owners' limits, each remembered for ``settings.token_cache_s`` in a bounded LRU map,
    so a submit pays a query only on a miss."""

    def __init__(self, settings: Settings, max_entries: int = 10_000) -> None:
        self._settings = settings
        self._cache: TtlCache[str, OwnerLimits] = TtlCache(settings.token_cache_s, max_entries)

    def cached(self, owner: str) -> OwnerLimits | None:
        """The owner's limits without touching the database; None if it would have to."""
        hit = self._cache.fresh(owner, time.monotonic())
        return hit[1] if hit is not None else None

    def get(
        self, connect: Callable[[], AbstractContextManager[Session | Connection]], owner: str
    ) -> OwnerLimits:
        """The owner's limits, read from ``owner_limits`` when not cached."""
        hit = self.cached(owner)
        if hit is not None:
            return hit
        now = time.monotonic()
        with connect() as conn:
            row = conn.execute(select(OWNER_LIMITS).where(OWNER_LIMITS.c.owner == owner)).first()
        limits = OwnerLimits.merged(self._settings, row)
        self._cache.put(owner, now, limits)
        return limits


def check_priority(principal: Principal, priority: int, limits: OwnerLimits) -> None:
    """Forbidden when a (non-admin) owner asks for more priority than it may use."""
    if principal.admin or priority <= limits.max_priority:
        return
    raise Forbidden(
        f"priority {priority} is above the {limits.max_priority} this owner may use"
        f" (max_priority: {limits.source('max_priority')}; an admin raises it with"
        f" `trainq token limits {shlex.quote(principal.name)} --max-priority N`)"
    )


def apply_runtime_rules(spec: JobSpec, settings: Settings) -> JobSpec:
    """The spec with the queue's default deadline when it gives none; InvalidInput when a
    job this large must give one (a big gang left to run forever holds many GPUs)."""
    if spec.max_runtime_s is not None:
        return spec
    ranks = spec.nodes * spec.procs_per_node
    required = settings.max_runtime_required_ranks
    if required and ranks > required:
        raise InvalidInput.at(
            ["body", "max_runtime_s"],
            f"max_runtime_s (seconds) is required for a job of {ranks} ranks"
            f" (nodes x procs_per_node); above {required} ranks a job must say when to stop"
            f" (TRAINQ_MAX_RUNTIME_REQUIRED_RANKS={required})",
        )
    defaults = settings.default_max_runtime_s
    default = defaults.get(spec.queue, defaults.get("*"))
    if default is None or default <= 0:
        return spec
    return spec.model_copy(update={"max_runtime_s": int(default)})


def check_run_disk(spec: JobSpec, settings: Settings) -> int:
    """The spec's run folder at its worst (trainer.plan's ``run_disk``), in bytes; 0 when the
    model's shape is unknown here (the trainer's free-space check before each checkpoint
    still holds). InvalidInput when it is over ``TRAINQ_RUNS_MAX_JOB_BYTES``. The job keeps
    the figure (``jobs.disk_bytes``): its owner's runs count it (service.api.jobs.room)."""
    from trainer.plan import run_disk  # arithmetic only; hf models read their config.json

    found = run_disk(spec.train, spec.nodes * spec.procs_per_node, settings.data_root)
    if found is None:
        return 0
    bound = settings.runs_max_job_bytes
    if not bound or found["run_bytes"] <= bound:
        return int(found["run_bytes"])
    ck = spec.train.checkpoint
    per = found["checkpoint_bytes"] + (found["hf_bytes"] if ck.hf == "every" else 0)
    most = max(0, (bound - found["checkpoint_bytes"]) // per) if per else 0
    hint = f"keep at most {most}" if most >= 1 else "this model's checkpoints do not fit at all"
    hf = " (each with its Hugging Face folder, checkpoint.hf: every)" if ck.hf == "every" else ""
    raise InvalidInput.at(
        ["body", "train", "checkpoint", "keep"],
        f"checkpoint.keep={ck.keep} checkpoints of about {mib(per)}{hf} need about"
        f" {mib(found['run_bytes'])} at worst, over the {mib(bound)} a run may hold"
        f" (TRAINQ_RUNS_MAX_JOB_BYTES={bound}); {hint}",
    )


def mib(n: int) -> str:
    """Bytes as MiB, or GiB from one GiB, for messages."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def running_caps(
    conn: Session | Connection, settings: Settings
) -> tuple[int | None, dict[str, int]]:
    """(the default running cap per owner, None for none; each owner's own cap) in one query.
    An owner's cap of 0 means no cap for that owner (the setting's meaning of 0)."""
    rows = conn.execute(
        select(OWNER_LIMITS.c.owner, OWNER_LIMITS.c.max_running).where(
            OWNER_LIMITS.c.max_running.is_not(None)
        )
    ).all()
    default = settings.max_running_per_owner or None
    return default, {str(r.owner): int(r.max_running) for r in rows}


def set_limits(
    session: Session, owner: str, *, clear: bool = False, **values: int | None
) -> OwnerLimit | None:
    """Upsert the owner's row: only the limits given (not None) change; with ``clear``, the
    others go back to the settings (and the row is removed when none is left). Returns the
    row, or None when removed. ValueError on a field that is not a limit or a negative count."""
    unknown = set(values) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"not a limit: {', '.join(sorted(unknown))}")
    given = {k: v for k, v in values.items() if v is not None}
    for field, value in given.items():
        if field != "max_priority" and value < 0:
            raise ValueError(f"{field} must be 0 (no limit) or more, not {value}")
    row = session.get(OwnerLimit, owner)
    if clear and not given and (row is None or row.tracking is None):
        clear_limits(session, owner)
        return None
    if clear and row is not None:
        for field in LIMIT_FIELDS:
            setattr(row, field, None)
    if row is None:
        row = OwnerLimit(owner=owner, updated_at=utcnow())
        session.add(row)
    for field, value in given.items():
        setattr(row, field, value)
    row.updated_at = utcnow()
    return row


def set_tracking(
    session: Session, owner: str, tracking: dict[str, Any] | None
) -> OwnerLimit | None:
    """The owner's default ``train.tracking`` (a TrackingConfig's JSON, validated by the
    caller), or None to remove it; its limits stay as they are. Returns the row, if any."""
    row = session.get(OwnerLimit, owner)
    if row is None and tracking is None:
        return None
    if row is None:
        row = OwnerLimit(owner=owner, updated_at=utcnow())
        session.add(row)
    row.tracking = tracking
    row.updated_at = utcnow()
    if tracking is None and all(getattr(row, f) is None for f in LIMIT_FIELDS):
        session.delete(row)
        return None
    return row


def clear_limits(session: Session, owner: str) -> bool:
    """Remove the owner's row (every limit back to the settings); whether there was one."""
    result = session.execute(delete(OwnerLimit).where(OwnerLimit.owner == owner))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def list_limits(session: Session) -> list[OwnerLimit]:
    return list(session.scalars(select(OwnerLimit).order_by(OwnerLimit.owner)))
