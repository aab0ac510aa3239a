"""Migrations: upgrade, downgrade, upgrade on empty PostgreSQL and SQLite; no drift."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.api.core import migrate
from service.api.core.models import Base


@pytest.fixture()
def empty_pg(pg_url: str) -> Iterator[str]:
    """An empty database of its own, beside the session's (which is already migrated)."""
    admin_url = pg_url.rsplit("/", 1)[0] + "/test"
    name = f"trainq_mig_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield pg_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    migrate.upgrade(url)
    assert migrate.current(url) == "0013"
    assert _tables(url) == set(Base.metadata.tables)
    migrate.downgrade(url, "0012")  # 0013 alone: events_pruned, the feed's marks
    assert "events_pruned" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0011")  # 0012 alone: the retention indexes
    assert migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0010")  # 0011 alone: owner_limits.tracking
    assert migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0009")  # 0010 alone: the sweeps table, jobs.sweep and params
    assert "sweeps" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0008")  # 0009 alone: the events outbox and the webhooks
    assert "events" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0007")  # 0008 alone: datasets.report and the wider format
    assert migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0006")  # 0007 alone: jobs.disk_bytes and job_owners
    assert "job_owners" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0005")  # 0006 alone: datasets.disk_bytes and dataset_owners
    assert "dataset_owners" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0003")  # 0004 alone: the datasets table goes, and comes back
    assert "datasets" not in _tables(url) and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    assert migrate.drift(url) == []
    migrate.downgrade(url, "0002")  # 0003 alone: attempts.node_exits goes, and comes back
    assert migrate.current(url) == "0002" and migrate.drift(url) != []
    migrate.upgrade(url)
    assert migrate.drift(url) == []
    migrate.downgrade(url, "base")
    assert _tables(url) == set()
    assert migrate.current(url) is None
    migrate.upgrade(url)
    assert migrate.drift(url) == []


def test_postgresql_round_trip_and_no_drift(empty_pg: str) -> None:
    _round_trip(empty_pg)


def test_sqlite_round_trip_and_no_drift(tmp_path: Path) -> None:
    _round_trip(f"sqlite:///{tmp_path / 'sub' / 'trainq.db'}")


def test_drift_check_sees_a_model_change(tmp_path: Path) -> None:
    # The check itself must be able to fail: a column the migrations do not have.
    url = f"sqlite:///{tmp_path / 'd.db'}"
    migrate.upgrade(url)
    changed = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables["jobs"].append_column(sa.Column("not_migrated", sa.Integer(), nullable=True))
    diffs = migrate.drift(url, changed)
    assert any(d[0] == "add_column" and d[3].name == "not_migrated" for d in diffs), diffs


def test_constraint_names_follow_the_convention() -> None:
    names = {c.name for t in Base.metadata.tables.values() for c in t.constraints}
    assert {"pk_jobs", "uq_jobs_owner_idempotency_key", "fk_attempts_job_id_jobs"} <= names
