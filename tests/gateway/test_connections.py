"""Incoming connections with real sockets: a client that sends nothing, or trickles its headers, is
answered 408 and closed after `connections.header_timeout_s`; an idle keep-alive connection is closed
after `keep_alive_s`; a body trickled after its headers is answered 408 after `body_timeout_s`; a
connection over `max_connections` is refused with a 503 as it opens, and the gateway keeps serving
once the idle ones are gone; a request the HTTP parser rejects gets a 400 OpenAI error in JSON."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from gateway_harness import RunningGateway, gateway_settings, start_gateway

LIMITS = {"header_timeout_s": 0.5, "body_timeout_s": 1.0, "keep_alive_s": 0.5, "max_connections": 20}


@pytest.fixture(scope="module")
def guarded(stub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    gw = start_gateway(gateway_settings(stub[0], tmp_path_factory.mktemp("conn"), connections=LIMITS))
    yield gw
    gw.stop()


def _connect(gw: RunningGateway) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(5)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_silent_connection_is_answered_408_and_closed(guarded: RunningGateway) -> None:
    sock = _connect(guarded)
    reply = _read_until_closed(sock)  # returns only once the gateway closes the socket (else: timeout)
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET /v1/responses/a b HTTP/1.1\r\nhost: x\r\n\r\n", b"GET /health HTTP/1.1\r\nbad header\r\n\r\n"],
    ids=["space-in-path", "header-without-colon"],
)
def test_a_request_that_is_not_http_gets_an_openai_error(
    guarded: RunningGateway, request_bytes: bytes
) -> None:
    sock = _connect(guarded)
    sock.sendall(request_bytes)
    head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert orjson.loads(body)["error"]["code"] == "invalid_http_request"
    assert httpx.get(guarded.url + "/health").status_code == 200  # and the gateway serves on


def test_a_client_trickling_header_lines_is_cut_off(guarded: RunningGateway) -> None:
    sock = _connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    closed = b""
    for i in range(20):  # one header line every 0.2 s would keep it open forever without the timeout
        time.sleep(0.2)
        try:
            sock.sendall(f"x-slow-{i}: 1\r\n".encode())
        except OSError:
            break
        sock.setblocking(False)
        try:
            closed = sock.recv(65536)
        except BlockingIOError:
            pass
        finally:
            sock.setblocking(True)
        if closed:
            break
    assert closed.startswith(b"HTTP/1.1 408"), closed


def test_a_client_trickling_its_body_is_cut_off(guarded: RunningGateway) -> None:
    key = guarded.new_key("trickle-body")
    sock = _connect(guarded)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: 4000\r\n\r\n".encode()
    )
    reply = b""
    for _ in range(40):  # one byte every 0.1 s: 4,000 bytes would take 400 s without the deadline
        time.sleep(0.1)
        try:
            sock.sendall(b" ")
        except OSError:
            break
        sock.setblocking(False)
        try:
            reply = sock.recv(65536)
        except BlockingIOError:
            pass
        finally:
            sock.setblocking(True)
        if reply:
            break
    assert reply.startswith(b"HTTP/1.1 408") and b"request body" in reply, reply


def test_an_idle_keep_alive_connection_is_closed(guarded: RunningGateway) -> None:
    sock = _connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    reply = _read_until_closed(sock)  # the answer, then the close once the connection idles
    assert reply.startswith(b"HTTP/1.1 200") and b"408" not in reply.split(b"\r\n", 1)[0]


def test_connections_over_the_cap_are_refused_and_service_resumes(guarded: RunningGateway) -> None:
    idle = [_connect(guarded) for _ in range(LIMITS["max_connections"])]
    try:
        extra = _connect(guarded)
        reply = _read_until_closed(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in reply
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the idle sockets' close reaches the gateway: new requests are served again
        try:
            if httpx.get(guarded.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not recover after the idle connections left"
        time.sleep(0.05)


def test_requests_are_served_normally_under_the_limits(guarded: RunningGateway) -> None:
    with httpx.Client(base_url=guarded.url) as http:
        for _ in range(3):
            assert http.get("/health").status_code == 200
            time.sleep(0.1)  # within keep_alive_s: the same connection is reused
