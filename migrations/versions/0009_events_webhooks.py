"""The events outbox and webhooks: ``events``, ``webhooks``, ``webhook_deliveries``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

``events`` is the owner's feed (``GET /v1/events``) and what webhooks deliver, written in the
transaction of each change; ``webhooks`` are the owners' endpoints (with the signing secret);
``webhook_deliveries`` is one event for one endpoint, its retries and outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("dedupe_key", sa.String(length=200), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("dedupe_key", name=op.f("uq_events_dedupe_key")),
    )
    op.create_index("ix_events_owner_id", "events", ["owner", "id"])
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=True),
        sa.Column("secret", sa.String(length=128), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("after_event", sa.BigInteger(), nullable=False),
        sa.Column("failing_since", When, nullable=True),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.Column("updated_at", When, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhooks")),
    )
    op.create_index("ix_webhooks_owner_id", "webhooks", ["owner", "id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("endpoint_id", sa.String(length=32), nullable=False),
        sa.Column("event_id", BigId, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", When, nullable=False),
        sa.Column("give_up_at", When, nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("updated_at", When, nullable=False),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhooks.id"],
            ondelete="CASCADE",
            name=op.f("fk_webhook_deliveries_endpoint_id_webhooks"),
        ),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            ondelete="CASCADE",
            name=op.f("fk_webhook_deliveries_event_id_events"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
        sa.UniqueConstraint(
            "endpoint_id", "event_id", name=op.f("uq_webhook_deliveries_endpoint_id_event_id")
        ),
    )
    due = sa.text("status IN ('pending', 'sending')")
    live = sa.text("status IN ('pending', 'sending', 'waiting')")
    op.create_index(
        "ix_webhook_deliveries_due_event_id", "webhook_deliveries", ["event_id"],
        postgresql_where=due, sqlite_where=due,
    )  # fmt: skip
    op.create_index(
        "ix_webhook_deliveries_live_endpoint_job", "webhook_deliveries",
        ["endpoint_id", "job_id", "event_id"], postgresql_where=live, sqlite_where=live,
    )  # fmt: skip
    op.create_index(
        "ix_webhook_deliveries_endpoint_id_id", "webhook_deliveries", ["endpoint_id", "id"]
    )


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
    op.drop_table("events")
