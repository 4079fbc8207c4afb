"""API keys: creation (shown once), storage as a sha256 hash with a short visible prefix, revocation
and lookup by plaintext. A key owns a node of kind "key" under a tenant node, so it carries limits
like any node. The plaintext key never reaches the database, a log line or an error message; a
high-entropy random key needs no salt or slow hash (there is nothing to brute-force)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Connection

from tokenops.ops import models as m
from tokenops.ops.tree import Node, NodeSettings, create_node, load_path, split_path
from tokenops.protocol import APIError

KEY_PREFIX = "tok-"
# Extra grants a key may carry besides calling the models. admin:read opens the console and the
# admin API's reads (never a change); the admin key itself stays the only one that changes state.
ADMIN_READ = "admin:read"
SCOPES = (ADMIN_READ,)
DISPLAY_CHARS = 10  # "tok-" plus 6 random characters, enough to tell keys apart in a list


@dataclass
class KeyInfo:
    id: str
    name: str
    node_path: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    scopes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "node_path": self.node_path,
            "prefix": self.prefix,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "scopes": list(self.scopes),
        }


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def new_plaintext_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 256 bits of randomness


def check_scopes(scopes: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    scopes = tuple(scopes or ())
    bad = [s for s in scopes if not isinstance(s, str) or s not in SCOPES]
    if bad:
        raise APIError(
            400,
            f"Unknown key scope(s): {', '.join(map(repr, bad))}. Known: {', '.join(SCOPES)}.",
            param="scopes",
        )
    return tuple(dict.fromkeys(scopes))


def create_key(
    conn: Connection,
    node_path: str | tuple[str, ...],
    name: str,
    settings: NodeSettings,
    scopes: list[str] | tuple[str, ...] | None = None,
) -> tuple[str, KeyInfo]:
    """Create a key under `node_path`; returns (plaintext, info). The plaintext is not stored."""
    granted = check_scopes(scopes)
    parent = split_path(node_path)
    if not parent:
        raise APIError(
            400,
            "A key must belong to a tenant node: give its path, e.g. 'acme' or 'acme/search'.",
            param="node_path",
        )
    node: Node = create_node(conn, parent, name, settings, kind="key")
    plaintext = new_plaintext_key()
    info = KeyInfo(
        id="key_" + secrets.token_hex(8),
        name=name,
        node_path=node.path,
        prefix=plaintext[:DISPLAY_CHARS],
        created_at=datetime.now(UTC),
        revoked_at=None,
        scopes=granted,
    )
    conn.execute(
        insert(m.api_keys).values(
            id=info.id,
            node_id=node.id,
            name=name,
            prefix=info.prefix,
            secret_hash=hash_key(plaintext),
            created_at=info.created_at,
            scopes=" ".join(granted) or None,
        )
    )
    return plaintext, info


def _info(row: Any) -> KeyInfo:
    scopes = tuple((row.scopes or "").split())
    return KeyInfo(row.id, row.name, row.path, row.prefix, row.created_at, row.revoked_at, scopes)


_KEY_COLUMNS = (
    m.api_keys.c.id,
    m.api_keys.c.name,
    m.api_keys.c.prefix,
    m.api_keys.c.created_at,
    m.api_keys.c.revoked_at,
    m.api_keys.c.scopes,
    m.nodes.c.path,
)


def list_keys(conn: Connection, under: str | None = None, include_revoked: bool = True) -> list[KeyInfo]:
    q = select(*_KEY_COLUMNS).join(m.nodes, m.nodes.c.id == m.api_keys.c.node_id).order_by(m.nodes.c.path)
    if under:
        prefix = "/".join(split_path(under))
        q = q.where(m.nodes.c.path.startswith(prefix + "/", autoescape=True))
    if not include_revoked:
        q = q.where(m.api_keys.c.revoked_at.is_(None))
    return [_info(r) for r in conn.execute(q).all()]


def revoke_key(conn: Connection, key_id: str) -> KeyInfo:
    info = get_key(conn, key_id)
    if info is None:
        raise APIError(
            404, f"No API key with id '{key_id}' (ids look like key_0123abcd...).", code="key_not_found"
        )
    if info.revoked_at is None:
        info.revoked_at = datetime.now(UTC)
        conn.execute(update(m.api_keys).where(m.api_keys.c.id == key_id).values(revoked_at=info.revoked_at))
    return info


def get_key(conn: Connection, key_id: str) -> KeyInfo | None:
    row = conn.execute(
        select(*_KEY_COLUMNS)
        .join(m.nodes, m.nodes.c.id == m.api_keys.c.node_id)
        .where(m.api_keys.c.id == key_id)
    ).first()
    return None if row is None else _info(row)


# built once (a bind parameter only): constructing and cache-keying the select per lookup cost more
# than SQLite's own work
_LOOKUP = (
    select(*_KEY_COLUMNS)
    .join(m.nodes, m.nodes.c.id == m.api_keys.c.node_id)
    .where(m.api_keys.c.secret_hash == bindparam("h"))
)


def lookup_key(conn: Connection, plaintext: str) -> tuple[KeyInfo, list[Node]] | None:
    """The live key for this plaintext and its node path (root first), or None when unknown or
    revoked. Two indexed queries."""
    row = conn.execute(_LOOKUP, {"h": hash_key(plaintext)}).first()
    if row is None or row.revoked_at is not None:
        return None
    return _info(row), load_path(conn, row.path)


def lookup_scoped(conn: Connection, plaintext: str, scope: str) -> KeyInfo | None:
    """The live key for this plaintext when it carries `scope`, else None (one indexed query)."""
    row = conn.execute(_LOOKUP, {"h": hash_key(plaintext)}).first()
    if row is None or row.revoked_at is not None:
        return None
    info = _info(row)
    return info if scope in info.scopes else None
