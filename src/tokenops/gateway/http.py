"""Small raw-ASGI helpers for the gateway's hot path: read a capped body, look up headers, send a JSON
body or an OpenAI error, wait for the client to go away.

The public endpoints are plain ASGI callables rather than a framework's request/response objects:
the hot path allocates little and owns its streaming and cancellation behaviour outright. This
module knows nothing about completions, keys or money.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from tokenops.gateway.request import body_too_large
from tokenops.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_CT = (b"content-type", b"application/json")
SSE_CT = (b"content-type", b"text/event-stream")


_ID_PREFIX = "req-" + os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def next_request_id() -> str:
    """A unique request id: a random per-process prefix and a counter (no syscall per request)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


class ClientGone(Exception):
    """The client disconnected before its request body arrived in full."""


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def bearer_token(scope: Scope) -> str | None:
    auth = header(scope, b"authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return header(scope, b"x-api-key")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed `limit` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client is gone (or the response is complete)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def base_headers(
    request_id: str, extra: list[tuple[bytes, bytes]] | None = None
) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", request_id.encode("latin-1"))]
    if extra:
        headers.extend(extra)
    return headers


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    content_type: tuple[bytes, bytes] = JSON_CT,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [content_type, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]]) -> None:
    await send_bytes(send, status, orjson.dumps(obj), headers)


async def send_error(send: Send, err: APIError, request_id: str) -> None:
    extra = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in err.headers.items()]
    await send_json(send, err.status, err.body(), base_headers(request_id, extra))
