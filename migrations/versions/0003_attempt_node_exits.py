"""attempts.node_exits: the nodes of a multi-node attempt that reported their exit.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

A job of N nodes runs each attempt as N worker tasks. The attempt ends when every node has
exited (a success only if all of them succeeded), or at the first node that fails; until
then the nodes already done are kept here, ``{"node": {"exit_code": .., "reason": ..}}``,
so a replayed exit event is seen as one, and the reaper does not count an exited node's
deleted heartbeat as lost. Null for single-node attempts.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("node_exits", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("node_exits")
