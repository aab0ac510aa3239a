"""datasets: uploaded corpora, prepared into llm.c token shards under the data root.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

A dataset is named per owner (``uq_datasets_owner_name``); its folder is ``path``, relative
to the data root, which is what a job's frozen ``train.data.path`` becomes when its spec
names the dataset. ``status``: uploading, preparing, ready, failed (``reason`` says why).
``updated_at`` is the API process's heartbeat while it uploads or prepares; the reconciler
fails a dataset whose heartbeat stopped (``ix_datasets_status_updated_at``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("tokenizer", sa.String(length=1024), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("documents", sa.BigInteger(), nullable=True),
        sa.Column("train_tokens", sa.BigInteger(), nullable=True),
        sa.Column("val_tokens", sa.BigInteger(), nullable=True),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("updated_at", When, nullable=False),
        sa.Column("ready_at", When, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
        sa.UniqueConstraint("owner", "name", name=op.f("uq_datasets_owner_name")),
    )
    op.create_index("ix_datasets_status_updated_at", "datasets", ["status", "updated_at"])


def downgrade() -> None:
    op.drop_index("ix_datasets_status_updated_at", table_name="datasets")
    op.drop_table("datasets")
