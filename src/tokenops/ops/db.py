"""Database access for the operations schema: URL normalisation, one synchronous SQLAlchemy engine
(pysqlite for SQLite, psycopg 3 for PostgreSQL) whose transactions run whole in a small dedicated
thread pool, so that an asyncio caller pays one thread hop per transaction rather than one
await per statement; SQLite settings (WAL, busy timeout, BEGIN IMMEDIATE so a write transaction
never fails on a lock upgrade); an optional PostgreSQL schema (search_path) to isolate deployments
and tests; Alembic migrations run programmatically at open. It does not know what the tables mean.

Why not SQLAlchemy's async engine: it needs greenlet (no longer a default dependency of
SQLAlchemy 2.1) and pays a greenlet switch plus an event-loop round trip per statement, while our
transactions are short fixed sequences of statements that fit a worker thread well."""

from __future__ import annotations

import asyncio
import fcntl
import re
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
T = TypeVar("T")
_ALEMBIC_LOCK = threading.Lock()
_PG_MIGRATION_LOCK = 0x6F70735F6D6967  # fixed, arbitrary: "ops_mig"
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def engine_url(database_url: str) -> URL:
    """The driver URL for a user-facing database URL (sqlite:///..., postgresql://...)."""
    url = make_url(database_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        return url.set(drivername="sqlite+pysqlite")
    if backend == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    raise ValueError(
        f"unsupported database URL '{url.render_as_string(hide_password=True)}': use sqlite:/// or postgresql://"
    )


def _sqlite_setup(engine, *, immediate: bool) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:  # noqa: ANN001
        # take transaction control from the driver so BEGIN IMMEDIATE can be issued
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA journal_mode=WAL")  # a no-op once migrate() switched the file to WAL
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        # a deferred transaction that reads then writes can fail outright with SQLITE_BUSY;
        # IMMEDIATE takes the write lock up front and waits on busy_timeout instead
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


_RETRIES = 3


def _retryable(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in ("40P01", "40001")  # deadlock, serialization failure


class Database:
    """One sync engine and the thread pool its transactions run in."""

    def __init__(self, database_url: str, *, schema: str | None = None, pool_size: int = 8) -> None:
        if schema is not None and not _SCHEMA_RE.match(schema):
            raise ValueError(f"invalid schema name '{schema}': use lower-case letters, digits and _")
        self.url = engine_url(database_url)
        self.schema = schema
        self.dialect = self.url.get_backend_name()
        kwargs: dict = {}
        if self.dialect == "sqlite":
            if self.url.database in (None, "", ":memory:"):
                raise ValueError(
                    "use a file for SQLite (sqlite:///path/to/ops.db), not an in-memory database"
                )
            # writes serialise in SQLite anyway: one connection (and one worker) queues them in
            # asyncio rather than in SQLite's sleeping busy handler
            pool_size = 1
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
            kwargs.update(pool_size=1, max_overflow=0, pool_timeout=60)
        else:
            kwargs.update(pool_size=pool_size, max_overflow=0, pool_timeout=60)
            if schema:
                kwargs["connect_args"] = {"options": f"-csearch_path={schema}"}
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.dialect == "sqlite":
            _sqlite_setup(self.engine, immediate=True)
        # one worker per pooled connection: a transaction never waits for a connection in a thread
        self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="ops-db")
        self.batch_writes = self.dialect == "sqlite"
        self._pending: list[tuple[Callable[..., Any], tuple, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` atomically on a worker thread: its writes are committed on return
        and rolled back on any exception (which is re-raised here).

        SQLite (one writer): calls that arrive while a transaction is running are grouped into the
        next transaction, each inside its own SAVEPOINT, so a refusal rolls back only its own
        statements and N callers pay for one commit and one thread hop (group commit). PostgreSQL:
        one transaction per call, up to the pool size at once."""
        loop = asyncio.get_running_loop()
        if not self.batch_writes:
            return await loop.run_in_executor(self._executor, self._transaction, fn, args)
        fut: asyncio.Future = loop.create_future()
        self._pending.append((fn, args, fut))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await loop.run_in_executor(
                        self._executor, self._group, [(f, a) for f, a, _ in batch]
                    )
                except BaseException as exc:  # the commit itself failed: every caller hears it
                    for _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (_, _, fut), (ok, value) in zip(batch, results, strict=True):
                    if fut.done():  # the caller was cancelled; its work is committed regardless
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
        finally:
            self._flusher = None

    def _group(self, calls: list[tuple[Callable[..., Any], tuple]]) -> list[tuple[bool, Any]]:
        if len(calls) == 1:  # no savepoint needed: the transaction is the call's own
            fn, args = calls[0]
            try:
                with self.engine.begin() as conn:
                    return [(True, fn(conn, *args))]
            except Exception as exc:
                return [(False, exc)]
        out: list[tuple[bool, Any]] = []
        with self.engine.begin() as conn:
            for fn, args in calls:
                # plain SAVEPOINT statements: SQLAlchemy's begin_nested compiles a fresh savepoint
                # construct per call, which costs more than the call's own statements
                conn.exec_driver_sql("SAVEPOINT ops_call")
                try:
                    value = fn(conn, *args)
                except Exception as exc:
                    conn.exec_driver_sql("ROLLBACK TO SAVEPOINT ops_call")
                    out.append((False, exc))
                else:
                    out.append((True, value))
                conn.exec_driver_sql("RELEASE SAVEPOINT ops_call")
        return out

    def _transaction(self, fn: Callable[..., T], args: tuple) -> T:
        for attempt in range(_RETRIES):
            try:
                with self.engine.begin() as conn:
                    return fn(conn, *args)
            except DBAPIError as exc:
                # PostgreSQL may pick this transaction as a deadlock victim (a sweep and a settle
                # touching the same rows); the whole function is safe to run again
                if attempt + 1 < _RETRIES and _retryable(exc):
                    continue
                raise
        raise AssertionError("unreachable")

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """The same, for synchronous callers (the CLI)."""
        return self._transaction(fn, args)

    async def migrate(self) -> None:
        """Create or upgrade the schema to the newest revision (idempotent, safe to race)."""
        await asyncio.to_thread(self.migrate_sync)

    def migrate_sync(self) -> None:
        if self.is_sqlite:
            # switching a fresh file to WAL and creating tables while another process's connection
            # holds a read lock can deadlock (busy handlers are skipped); a file lock serialises it
            path = Path(self.url.database).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(str(path) + ".migrate-lock", "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    with sqlite3.connect(path, timeout=30) as raw:
                        raw.execute("PRAGMA journal_mode=WAL")
                    raw.close()
                    self._migrate_locked()
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        else:
            self._migrate_locked()

    def _migrate_locked(self) -> None:
        with self.engine.connect() as conn:
            if not self.is_sqlite:
                # several gateways may start at once: one migrates, the others wait then find
                # nothing to do (CREATE SCHEMA IF NOT EXISTS itself races without this)
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                conn.commit()
            try:
                if self.schema:
                    conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))
                    conn.commit()
                run_migrations(conn)
                conn.commit()
            finally:
                if not self.is_sqlite:
                    conn.rollback()
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                    conn.commit()

    def dispose(self) -> None:
        self._executor.shutdown(wait=True)
        self.engine.dispose()


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config pointing at the package's migrations (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def run_migrations(connection: Connection, revision: str = "head") -> None:
    # Alembic's `context` is a module-global proxy: two threads migrating at once trample it
    with _ALEMBIC_LOCK:
        command.upgrade(alembic_config(connection), revision)
