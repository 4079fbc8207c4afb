"""Alembic environment for the operations schema, driven programmatically by `tokenops.ops.db`
(no alembic.ini): the caller passes an open sync connection in `config.attributes["connection"]`
and holds the lock that serialises concurrent starts (see `Database.migrate_sync`)."""

from __future__ import annotations

from alembic import context

from tokenops.ops.models import metadata

VERSION_TABLE = "ops_alembic_version"

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
