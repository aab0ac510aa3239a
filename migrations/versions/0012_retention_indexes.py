"""Indexes for pruning the events outbox (``TRAINQ_EVENTS_RETENTION_DAYS``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

The retention pass walks the ended webhook deliveries by age, the old events by age, and an
old event's deliveries; without these each batch read the whole table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    ended = sa.text("status IN ('delivered', 'failed')")
    op.create_index(
        "ix_webhook_deliveries_ended_updated_at", "webhook_deliveries", ["updated_at"],
        postgresql_where=ended, sqlite_where=ended,
    )  # fmt: skip
    op.create_index("ix_webhook_deliveries_event_id", "webhook_deliveries", ["event_id"])
    op.create_index("ix_events_created_at", "events", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_events_created_at", table_name="events")
    op.drop_index("ix_webhook_deliveries_event_id", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_ended_updated_at", table_name="webhook_deliveries")
