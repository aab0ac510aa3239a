"""An owner's default experiment trackers (``train.tracking`` for specs that name none).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

``owner_limits.tracking``: a ``TrackingConfig`` as JSON, set by an admin with
``trainq token tracking NAME``; NULL: the owner has no default.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("owner_limits") as batch:
        batch.add_column(sa.Column("tracking", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("owner_limits") as batch:
        batch.drop_column("tracking")
