"""Sweeps: a hyperparameter search whose trials are jobs.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

``sweeps`` holds a search (base spec, space, method, metric and goal, budget, parallelism,
seed, early stopping) and its Optuna study as the searcher last committed it; ``jobs.sweep``
names the sweep a trial belongs to, ``jobs.params`` the values it was given. Job status
``stopped_early`` needs no schema change (``jobs.status`` is a 16-character string).

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base", sa.JSON(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("metric", sa.String(length=32), nullable=False),
        sa.Column("goal", sa.String(length=8), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("parallelism", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("early_stop", sa.JSON(), nullable=True),
        sa.Column("study", sa.LargeBinary(), nullable=True),
        sa.Column("proposed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    op.create_index("ix_sweeps_owner_id", "sweeps", ["owner", "id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sweep", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("params", sa.JSON(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_jobs_sweep_sweeps"), "sweeps", ["sweep"], ["id"], ondelete="SET NULL"
        )
        batch.create_index(op.f("ix_jobs_sweep"), ["sweep"])


def downgrade() -> None:
    # Trials stay as plain jobs; the sweeps and the trials' parameters go.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index(op.f("ix_jobs_sweep"))
        batch.drop_constraint(op.f("fk_jobs_sweep_sweeps"), type_="foreignkey")
        batch.drop_column("params")
        batch.drop_column("sweep")
    op.drop_index("ix_sweeps_owner_id", table_name="sweeps")
    op.drop_table("sweeps")
    # A stopped trial reads as cancelled to the code before sweeps.
    op.execute("UPDATE jobs SET status = 'cancelled' WHERE status = 'stopped_early'")
