"""Index metrics by (job_id, step, attempt): the downsampled history reads in step order.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

``GET /v1/jobs/{id}/metrics`` ranks a job's points by step (the latest attempt first within
a step) in SQL; the unique (job_id, attempt, step) key orders by attempt first, so without
this index the database sorts every point of a long run on each request.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_metrics_job_id_step_attempt", "metrics", ["job_id", "step", "attempt"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_metrics_job_id_step_attempt", table_name="metrics")
