"""The console's login cookie: a signed (itsdangerous) session id, and the cookie's attributes
(Secure, HttpOnly, SameSite=Strict).

The session itself (role, read-only key, CSRF token) is a row in the database
(`tokenops.ops.console_sessions`): logging out deletes it, so the cookie stops working on every
replica at once, even a copy kept elsewhere. The signing secret is derived from the admin key hashes,
so a new admin key ends every session too. The cookie holds no key: a read-only session names the key
id, and each request checks that the key is still live (a revoked key logs its sessions out at once).
"""

from __future__ import annotations

import hashlib
import hmac

from itsdangerous import BadSignature, URLSafeTimedSerializer

from tokenops.ops.console_sessions import ConsoleSession

COOKIE = "tokenops_console"
MAX_AGE_S = 12 * 3600


class SessionCodec:
    """Signs and reads the session cookie."""

    def __init__(self, secret_material: str) -> None:
        secret = hmac.new(secret_material.encode(), b"tokenops-console-session", hashlib.sha256).hexdigest()
        self._serializer = URLSafeTimedSerializer(secret, salt="console-session")

    def dump(self, session: ConsoleSession) -> str:
        return self._serializer.dumps(session.id)

    def load(self, cookie: str | None) -> str | None:
        """The session id a cookie names, if its signature holds and it is younger than the session."""
        if not cookie:
            return None
        try:
            data = self._serializer.loads(cookie, max_age=MAX_AGE_S)
        except BadSignature:  # expired, tampered with or signed under another admin key
            return None
        return data if isinstance(data, str) else None

    @staticmethod
    def csrf_ok(session: ConsoleSession, submitted: str | None) -> bool:
        return bool(submitted) and hmac.compare_digest(session.csrf, submitted or "")


def cookie_header(value: str, max_age: int = MAX_AGE_S) -> str:
    return f"{COOKIE}={value}; Path=/console; Max-Age={max_age}; Secure; HttpOnly; SameSite=Strict"
