"""The console's login session: a signed cookie (itsdangerous) that names who logged in, their role
and a CSRF token, and the cookie's attributes (Secure, HttpOnly, SameSite=Strict).

The signing secret is derived from the admin key hashes, so every gateway replica that shares the
admin key accepts the same session and a new admin key ends every session. The cookie holds no key:
a read-only session names the key id, and each request checks that the key is still live (a revoked
key logs its sessions out at once).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Literal

from itsdangerous import BadSignature, URLSafeTimedSerializer

COOKIE = "tokenops_console"
MAX_AGE_S = 12 * 3600
Role = Literal["admin", "read"]


@dataclass(frozen=True)
class Session:
    role: Role
    key_id: str | None  # the read-only key's id; None for the admin key
    csrf: str

    @property
    def can_write(self) -> bool:
        return self.role == "admin"


class SessionCodec:
    """Signs and reads the session cookie."""

    def __init__(self, secret_material: str) -> None:
        secret = hmac.new(secret_material.encode(), b"tokenops-console-session", hashlib.sha256).hexdigest()
        self._serializer = URLSafeTimedSerializer(secret, salt="console-session")

    def new(self, role: Role, key_id: str | None) -> Session:
        return Session(role, key_id, secrets.token_urlsafe(24))

    def dump(self, session: Session) -> str:
        return self._serializer.dumps({"r": session.role, "k": session.key_id, "c": session.csrf})

    def load(self, cookie: str | None) -> Session | None:
        if not cookie:
            return None
        try:
            data = self._serializer.loads(cookie, max_age=MAX_AGE_S)
        except BadSignature:  # expired, tampered with or signed under another admin key
            return None
        if not isinstance(data, dict) or data.get("r") not in ("admin", "read"):
            return None
        return Session(data["r"], data.get("k"), str(data.get("c", "")))

    @staticmethod
    def csrf_ok(session: Session, submitted: str | None) -> bool:
        return bool(submitted) and hmac.compare_digest(session.csrf, submitted or "")


def cookie_header(value: str, max_age: int = MAX_AGE_S) -> str:
    return f"{COOKIE}={value}; Path=/console; Max-Age={max_age}; Secure; HttpOnly; SameSite=Strict"
