"""How far retention pruned each owner's events (the events feed's 410 for an old cursor).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

``events_pruned``: one row per owner some of whose events the retention pass deleted;
``through_id`` the highest id among them. ``GET /v1/events?after=N`` with 0 < N < through_id
answers 410 Gone naming ``after``: events after that cursor are gone.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "events_pruned",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("through_id", sa.BigInteger(), nullable=False),
        sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_events_pruned")),
    )


def downgrade() -> None:
    op.drop_table("events_pruned")
