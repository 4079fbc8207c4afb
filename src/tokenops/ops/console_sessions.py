"""The web console's login sessions, held in the database: open one at login (purging the expired),
read one per page, close one at logout. A closed or expired session is gone for every gateway replica
sharing the database, whatever cookie a browser still holds. Plain functions over a connection, run
by `Database.run`."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection

from tokenops.ops import models as m

CS = m.console_sessions
Role = Literal["admin", "read"]


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    id: str
    role: Role
    key_id: str | None  # the read-only key's id; None for the admin key
    csrf: str

    @property
    def can_write(self) -> bool:
        return self.role == "admin"


def open_session(conn: Connection, role: Role, key_id: str | None, ttl_s: float) -> ConsoleSession:
    now = datetime.now(UTC)
    conn.execute(delete(CS).where(CS.c.expires_at < now))
    session = ConsoleSession(secrets.token_urlsafe(24), role, key_id, secrets.token_urlsafe(24))
    conn.execute(
        insert(CS).values(
            id=session.id,
            role=role,
            key_id=key_id,
            csrf=session.csrf,
            expires_at=now + timedelta(seconds=ttl_s),
        )
    )
    return session


def find_session(conn: Connection, session_id: str) -> ConsoleSession | None:
    """The live session with this id; None once it was closed or has expired."""
    row = conn.execute(
        select(CS.c.role, CS.c.key_id, CS.c.csrf, CS.c.expires_at).where(CS.c.id == session_id)
    ).first()
    if row is None:
        return None
    expires = row.expires_at if row.expires_at.tzinfo else row.expires_at.replace(tzinfo=UTC)  # SQLite: naive
    if expires <= datetime.now(UTC):
        return None
    return ConsoleSession(session_id, row.role, row.key_id, row.csrf)


def close_session(conn: Connection, session_id: str) -> None:
    conn.execute(delete(CS).where(CS.c.id == session_id))
