"""Fixtures for the operations tests: a fresh database per test, SQLite in a temp dir or a unique
schema on the real PostgreSQL server (dropped afterwards), and a unique Redis key prefix."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from ops_helpers import PG_DSN, PG_URL, REDIS_URL


def _pg_available() -> bool:
    try:
        with psycopg.connect(PG_DSN, connect_timeout=2):
            return True
    except Exception:
        return False


@pytest.fixture
def pg_schema():
    """A unique PostgreSQL schema name, dropped (with everything in it) after the test."""
    if not _pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    schema = f"t_ops_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_target(request, tmp_path):
    """(database_url, schema) for each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ops.db", None
    schema = request.getfixturevalue("pg_schema")
    return PG_URL, schema


@pytest.fixture
def redis_prefix():
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception:
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    prefix = f"t_ops:{uuid.uuid4().hex[:10]}:"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()
