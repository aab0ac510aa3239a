"""Alembic migrations of the service's SQL store (run by ``trainq db upgrade``)."""
