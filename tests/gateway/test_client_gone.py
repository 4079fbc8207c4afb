"""A client that goes away: the gateway stops the upstream call at once, streamed or not, and the
ledger row says `client_disconnected` with what the backend had been given."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from gateway_harness import MODEL, LoopbackServer, RunningGateway, gateway_settings, start_gateway


class SilentUpstream(LoopbackServer):
    """A backend on loopback that reads a request and never answers: records when its client (the
    gateway) closed the connection."""

    def __init__(self) -> None:
        self.requests = 0
        self.closed = threading.Event()
        super().__init__()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        while await reader.read(65536):  # the body, then nothing until the gateway hangs up
            pass
        self.closed.set()
        writer.close()


@pytest.fixture()
def silent(tmp_path: Path) -> Iterator[tuple[RunningGateway, SilentUpstream]]:
    up = SilentUpstream()
    settings = gateway_settings(
        f"http://127.0.0.1:{up.port}",
        tmp_path,
        cluster={"retry": {"attempts": 1, "first_byte_timeout_s": 300}},
    )
    gw = start_gateway(settings)
    yield gw, up
    gw.stop()
    up.stop()


def _post(gw: RunningGateway, key: str, body: dict) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    raw = orjson.dumps(body)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
        ).encode()
        + raw
    )
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_the_answer_cancels_the_upstream_call(silent, stream: bool) -> None:
    gw, up = silent
    key = gw.new_key(f"gone-{stream}")
    key_id = next(
        k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == f"gone-{stream}"
    )
    sock = _post(
        gw,
        key,
        {
            "model": MODEL,
            "stream": stream,
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "write a long story"}],
        },
    )
    deadline = time.monotonic() + 10
    while up.requests == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert up.requests == 1
    assert not up.closed.wait(0.3)  # the gateway waits for the answer while its client is there
    sock.close()
    assert up.closed.wait(10), "the gateway kept the upstream call open after its client left"
    (row,) = gw.wait_ledger(1, key_id=key_id)
    assert row["status"] == "client_disconnected" and row["http_status"] == 499
    assert row["output_tokens"] == 0
    assert row["uncached_input_tokens"] > 0 and row["cost_micros"] > 0  # the backend had the prompt


def test_a_whole_answer_cut_off_by_its_client_is_billed_what_was_produced(gateway, stub) -> None:
    # the bench stub produces 1,000 tokens at 5 ms: the client of a whole answer leaves after 0.5 s; the
    # row is settled as client_disconnected, not as the 200 nobody received, and bills what the backend
    # had produced by then (the gateway streams from the backend and assembles the answer itself)
    key = gateway.new_key("gone-whole")
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "gone-whole"
    )
    stub[1].itl_s = 0.005
    try:
        sock = _post(
            gateway,
            key,
            {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": "go"}]},
        )
        time.sleep(0.5)
        sock.close()
        (row,) = gateway.wait_ledger(1, timeout=3.0, key_id=key_id)
    finally:
        stub[1].itl_s = 0.0
    assert row["status"] == "client_disconnected" and row["http_status"] == 499
    assert 0 < row["output_tokens"] < 1000
    assert row["uncached_input_tokens"] > 0
