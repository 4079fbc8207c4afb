"""Incoming connections: how long a client may take to send its request headers and then its body,
how long an idle keep-alive connection stays open, and how many connections the gateway holds at once.

This module owns `ConnectionGuard`, uvicorn's httptools protocol with a header-read timeout (armed
when a connection opens and when each request's first byte arrives, disarmed once its headers are
complete: a socket that sends nothing, or trickles one header line every few seconds, is answered
408 and closed), a body-read deadline (armed when the headers are complete, disarmed when the body
is: a body trickled byte by byte is answered 408 and closed), and a connection cap checked as each
connection opens (the one over the cap gets a 503 and is closed at once, before it holds a descriptor
for long). A request the HTTP parser rejects is answered 400 with an OpenAI error in JSON. uvicorn's
own keep-alive timer closes a connection idle between requests. It does not read bodies or know
about requests' routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenops.config import ConnectionsConfig


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


_INVALID_HTTP = _refusal(
    400,
    "Bad Request",
    "The request is not valid HTTP/1.1 (its request line or a header could not be parsed).",
    "invalid_http_request",
)


class ConnectionGuard(HttpToolsProtocol):
    """HttpToolsProtocol with a header-read timeout and a connection cap (`guarded_protocol` sets both)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    _timeout_response: bytes = b""
    _body_timeout_response: bytes = b""
    _full_response: bytes = b""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(self._full_response)
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._body_done()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._body_done()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # a request the HTTP parser rejects (a bad request line or header) never reaches the app:
        # answer it as the app answers bad input, an OpenAI error in JSON, not uvicorn's plain text
        self._disarm()
        self._body_done()
        self.transport.write(_INVALID_HTTP)
        self.transport.close()

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(self._body_timeout_response)
        # the request's app sees its client gone (http.disconnect) and answers nothing more
        self.transport.close()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(self._timeout_response)
            self.transport.close()


def guarded_protocol(cfg: ConnectionsConfig) -> type[ConnectionGuard]:
    """The protocol class for uvicorn's `http=` with these limits."""
    timeout = _refusal(
        408,
        "Request Timeout",
        f"The request headers did not arrive within {cfg.header_timeout_s:g} s; the connection is closed.",
        "request_timeout",
    )
    body_timeout = _refusal(
        408,
        "Request Timeout",
        f"The request body did not arrive within {cfg.body_timeout_s:g} s of its headers; "
        "the connection is closed.",
        "request_timeout",
    )
    full = _refusal(
        503,
        "Service Unavailable",
        f"The gateway holds its maximum of {cfg.max_connections} connections. "
        "Retry shortly, or reuse a connection.",
        "too_many_connections",
    )
    return type(
        "ConfiguredConnectionGuard",
        (ConnectionGuard,),
        {
            "header_timeout_s": cfg.header_timeout_s,
            "body_timeout_s": cfg.body_timeout_s,
            "max_connections": cfg.max_connections,
            "_timeout_response": timeout,
            "_body_timeout_response": body_timeout,
            "_full_response": full,
        },
    )


def uvicorn_options(cfg: ConnectionsConfig) -> dict[str, Any]:
    """The uvicorn.Config options that apply `cfg` (serve and the test harness use the same)."""
    return {"http": guarded_protocol(cfg), "timeout_keep_alive": cfg.keep_alive_s}
