"""Alembic's environment: migrate the connection :func:`rayeval.service.jobs.migrations.upgrade`
hands over, against the tables of :mod:`rayeval.service.jobs.rows` (SQLite in batch mode, so
that a column change rebuilds the table as SQLite needs)."""

from __future__ import annotations

from alembic import context

from rayeval.service.jobs.rows import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
