"""Alembic environment: the target is ``service.api.core.models.Base.metadata``.

The URL comes from the Alembic config (``trainq db upgrade`` sets it from the settings) or,
when Alembic runs by hand, from ``TRAINQ_DATABASE_URL``. A caller may also hand over an open
connection in ``config.attributes["connection"]`` (tests and the drift check do).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, engine_from_config, pool

from service.api.core.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    section = config.get_section(config.config_ini_section, {})
    if not section.get("sqlalchemy.url"):
        from service.api.core.settings import Settings

        section["sqlalchemy.url"] = Settings().database_url
    engine = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as conn:
        _configure(conn)
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
