import asyncio

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from tokenops.ops.db import MIGRATIONS_DIR, Database
from tokenops.ops.models import metadata


def test_migrations_create_the_model_schema_and_rerun_safely(db_target):
    url, schema = db_target

    async def main():
        db = Database(url, schema=schema)
        await db.migrate()
        await db.migrate()  # idempotent

        def check(sync_conn):
            names = set(inspect(sync_conn).get_table_names())
            assert {t.name for t in metadata.sorted_tables} <= names
            assert "ops_alembic_version" in names
            ctx = MigrationContext.configure(sync_conn, opts={"version_table": "ops_alembic_version"})
            diff = compare_metadata(ctx, metadata)
            assert diff == [], diff
            assert ctx.get_current_revision() == ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()

        with db.engine.connect() as conn:
            check(conn)
        db.dispose()

    asyncio.run(main())


def test_concurrent_migrations_do_not_collide(db_target):
    url, schema = db_target

    async def main():
        dbs = [Database(url, schema=schema) for _ in range(3)]
        await asyncio.gather(*(d.migrate() for d in dbs))
        for d in dbs:
            d.dispose()

    asyncio.run(main())


def test_grouped_calls_roll_back_only_the_failing_one(db_target):
    from datetime import UTC, datetime

    from sqlalchemy import insert, select

    from tokenops.ops import models as m

    url, schema = db_target

    def add(conn, name, fail):
        now = datetime.now(UTC)
        conn.execute(
            insert(m.nodes).values(name=name, path=name, kind="node", created_at=now, updated_at=now)
        )
        if fail:
            raise ValueError(name)
        return name

    async def main():
        db = Database(url, schema=schema)
        await db.migrate()
        try:
            results = await asyncio.gather(
                *(db.run(add, f"n{i}", i % 3 == 1) for i in range(9)), return_exceptions=True
            )
            assert [isinstance(r, ValueError) for r in results] == [i % 3 == 1 for i in range(9)]
            with db.engine.connect() as conn:
                names = sorted(r[0] for r in conn.execute(select(m.nodes.c.name)))
            assert names == sorted(f"n{i}" for i in range(9) if i % 3 != 1)
        finally:
            db.dispose()

    asyncio.run(main())


def test_engine_url_maps_drivers():
    import pytest

    from tokenops.ops.db import engine_url

    assert engine_url("sqlite:///x.db").drivername == "sqlite+pysqlite"
    for url in ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db", "postgresql+psycopg://u@h/db"):
        assert engine_url(url).drivername == "postgresql+psycopg"
    with pytest.raises(ValueError, match="unsupported database URL"):
        engine_url("mysql://u@h/db")
    with pytest.raises(ValueError, match="not an in-memory"):
        Database("sqlite://")
    with pytest.raises(ValueError, match="invalid schema"):
        Database("postgresql://u@h/db", schema="x; drop")
