"""Scheduling: job priority, backoff and preemption times, placements, owner limits.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

The service admits jobs (service.api.scheduling.admit): a queued job waits in SQL until the admitter
places each of its nodes on a concrete worker, recorded in ``attempts.placement`` (a list of
worker names, one per node; null while the attempt waits for admission). ``jobs.priority``
orders admission (higher first); ``jobs.not_before`` holds a job back after its gang failed
to start (a backoff); ``jobs.preempted_at`` is when the admitter last asked it to yield, so
it is not preempted again within the settable interval. ``owner_limits`` holds what an admin
sets per owner (a token's name) with ``trainq token limits``: the highest priority it may
ask for, its running capacity per queue, its queued jobs and its submits per minute; a null
column falls back to the service's setting.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("preempted_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempts", sa.Column("placement", sa.JSON(), nullable=True))
    op.create_table(
        "owner_limits",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("max_priority", sa.Integer(), nullable=True),
        sa.Column("max_running", sa.Integer(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("submits_per_minute", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_owner_limits")),
    )


def downgrade() -> None:
    op.drop_table("owner_limits")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("placement")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preempted_at")
        batch.drop_column("not_before")
        batch.drop_column("priority")
