"""The runs' room per owner: what each job counts, and a lock per owner.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

``jobs.disk_bytes`` is what a job counts against its owner's ``TRAINQ_RUNS_MAX_OWNER_BYTES``
while its row exists (a finished run keeps its folder until the job is removed): the run
folder's worst case that ``trainer.plan`` estimated at submit, 0 when the model's shape was
not known there. Existing rows start at 0: the estimate needs the trainer's arithmetic, which
a migration does not run. ``job_owners`` holds one row per owner, locked (updated) by every
submit the bound checks, so two API replicas never both fit a job into the same room
(service.api.jobs.room).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column("disk_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.create_table(
        "job_owners",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("locked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_job_owners")),
    )


def downgrade() -> None:
    op.drop_table("job_owners")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("disk_bytes")
