"""An owner's room for runs (``TRAINQ_RUNS_MAX_OWNER_BYTES``), held under concurrency.

Each job counts ``disk_bytes``, its run folder's worst case estimated at submit
(``service.api.scheduling.limits.check_run_disk``), for as long as its row exists: a
finished run keeps its folder until the job is removed (``trainq rm``, ``DELETE
/v1/jobs/{id}``, or retention), so the owner's usage is the sum over all their jobs, and a
removal gives its room back with no bookkeeping of its own.

A submit the bound applies to reads the usage and inserts its row in one transaction that
first locks the owner's ``job_owners`` row (``service.api.core.owner_lock``), so the submits
of one owner through any number of API replicas are checked one after another and their sum
never passes the limit. Such a submit goes alone (``service.api.jobs.submit.submit_one``),
not in a group commit; without a bound, or for a job whose estimate is unknown (0), nothing
is locked. An Idempotency-Key its owner used before answers its job, never a refusal.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.api.core.errors import InvalidInput
from service.api.core.models import JOB_OWNERS, JOBS
from service.api.core.owner_lock import lock_owner
from service.api.scheduling.limits import mib

__all__ = ["SETTING", "check", "lock", "used"]

SETTING = "TRAINQ_RUNS_MAX_OWNER_BYTES"


def lock(session: Session, owner: str) -> None:
    """Lock the owner's ``job_owners`` row till the transaction ends (first in it)."""
    lock_owner(session, JOB_OWNERS, owner)


def used(session: Session, owner: str) -> int:
    """What the owner's jobs count: their estimates, every row not yet removed."""
    stmt = select(func.coalesce(func.sum(JOBS.c.disk_bytes), 0)).where(JOBS.c.owner == owner)
    return int(session.execute(stmt).scalar_one())


def check(session: Session, owner: str, amount: int, limit: int) -> None:
    """InvalidInput unless ``amount`` more fits beside the owner's runs (the owner locked)."""
    others = used(session, owner)
    if others + amount <= limit:
        return
    raise InvalidInput.at(
        ["body", "train", "checkpoint", "keep"],
        f"this run may hold about {mib(amount)} at worst (checkpoint.keep checkpoints);"
        f" your jobs' runs already hold up to {mib(others)}, and together they would pass"
        f" the {mib(limit)} one owner's runs may hold ({SETTING}={limit}); remove finished"
        " jobs you no longer need (`trainq rm JOB`) or keep fewer checkpoints",
    )
