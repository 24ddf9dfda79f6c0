"""Alembic migrations of the deferral schema (run with ``deferral db upgrade``)."""
