"""Stored `/v1/responses` answers: save one, find one for its own tenant, delete one, purge the expired.

A response is only ever found by the tenant that made it: another tenant's id reads exactly like an
unknown one, so ids never leak across tenants. Expired rows are refused as soon as they expire and
purged later. Plain functions over a connection, run by `Database.run`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection

from tokenops.ops import models as m

R = m.responses


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    tenant: str
    key_id: str
    model: str
    session_id: str
    previous_response_id: str | None
    body: dict[str, Any]
    history: list[dict[str, Any]]
    history_tokens: int
    created_at: datetime
    expires_at: datetime


def save_response(conn: Connection, r: StoredResponse) -> None:
    conn.execute(
        insert(R).values(
            id=r.id,
            tenant=r.tenant,
            key_id=r.key_id,
            model=r.model,
            session_id=r.session_id,
            previous_response_id=r.previous_response_id,
            body=r.body,
            history=r.history,
            history_tokens=r.history_tokens,
            created_at=r.created_at,
            expires_at=r.expires_at,
        )
    )


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)  # SQLite returns naive UTC


def find_response(conn: Connection, response_id: str, tenant: str) -> tuple[StoredResponse | None, bool]:
    """(the tenant's response, False), (None, True) when it has expired, (None, False) when there is
    none under this tenant."""
    row = conn.execute(select(R).where(R.c.id == response_id, R.c.tenant == tenant)).first()
    if row is None:
        return None, False
    r = row._mapping
    expires = _aware(r["expires_at"])
    if expires <= datetime.now(UTC):
        return None, True
    return (
        StoredResponse(
            id=r["id"],
            tenant=r["tenant"],
            key_id=r["key_id"],
            model=r["model"],
            session_id=r["session_id"],
            previous_response_id=r["previous_response_id"],
            body=r["body"],
            history=r["history"],
            history_tokens=int(r["history_tokens"]),
            created_at=_aware(r["created_at"]),
            expires_at=expires,
        ),
        False,
    )


def delete_response(conn: Connection, response_id: str, tenant: str) -> bool:
    return conn.execute(delete(R).where(R.c.id == response_id, R.c.tenant == tenant)).rowcount > 0


def purge_expired(conn: Connection, now: datetime | None = None) -> int:
    return conn.execute(delete(R).where(R.c.expires_at <= (now or datetime.now(UTC)))).rowcount


__all__ = ["StoredResponse", "save_response", "find_response", "delete_response", "purge_expired"]
