"""Chat and completion datasets: a wider format, and the preparation's report.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05

``datasets.format`` takes ``chat`` and ``completion`` beside ``text``, ``jsonl`` and
``bin`` (16 characters). ``datasets.report`` is what preparing a chat or completion upload
made (trainer.sft.SftReport: examples, tokens, the share that carries loss, what was dropped
or truncated and why); NULL for the other formats and for rows from before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.alter_column(
            "format", existing_type=sa.String(length=8), type_=sa.String(length=16),
            existing_nullable=False,
        )  # fmt: skip
        batch.add_column(sa.Column("report", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Rows of the new formats do not fit the old column: they go (their folders stay until
    # an operator removes them; no job can name them without their rows).
    op.execute("DELETE FROM datasets WHERE format IN ('chat', 'completion')")
    with op.batch_alter_table("datasets") as batch:
        batch.drop_column("report")
        batch.alter_column(
            "format", existing_type=sa.String(length=16), type_=sa.String(length=8),
            existing_nullable=False,
        )  # fmt: skip
