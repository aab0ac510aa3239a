"""Schema migrations from code: what ``trainq db upgrade`` runs, and the drift check.

The Alembic configuration is built here rather than read from an ini file, so an installed
wheel migrates without knowing where it was unpacked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, pool

import migrations
from service.api.core.db import ensure_sqlite_dir
from service.api.core.models import Base

__all__ = ["alembic_config", "current", "downgrade", "drift", "upgrade"]

SCRIPTS = Path(migrations.__file__).resolve().parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.set_main_option("path_separator", "os")
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def drift(url: str, metadata: MetaData | None = None) -> list[Any]:
    """What autogenerate would still change after the migrations: [] when none drifted."""
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, metadata or Base.metadata))
    finally:
        engine.dispose()
