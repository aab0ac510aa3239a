"""Dataset quotas that hold under concurrency: what each dataset counts, and a lock per owner.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

``datasets.disk_bytes`` is what a dataset counts against its owner's
``TRAINQ_DATASET_MAX_OWNER_BYTES``: while it uploads or prepares, what it has reserved (a
bound on its prepared folder's size, from the declared or the received bytes); once ready,
the prepared folder's real size. A failed dataset counts nothing. Existing rows start with
their upload's size (what the quota counted before). ``dataset_owners`` holds one row per
owner that has uploaded, locked (updated) by every reservation, so two API replicas never
both fit an upload into the same room (service.api.datasets.quota).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "datasets",
        sa.Column("disk_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.execute("UPDATE datasets SET disk_bytes = bytes")
    op.create_table(
        "dataset_owners",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("locked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_dataset_owners")),
    )


def downgrade() -> None:
    op.drop_table("dataset_owners")
    with op.batch_alter_table("datasets") as batch:
        batch.drop_column("disk_bytes")
