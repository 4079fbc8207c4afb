"""A client's non-streamed request is streamed from the backend and assembled by the gateway: the
client gets the same whole answer, the ledger its usage, and a backend that breaks off mid-answer
(nothing had reached the client) is asked again on another replica, billed once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from gateway_harness import MODEL, LoopbackServer, RunningGateway, gateway_settings, start_gateway


class CuttingUpstream(LoopbackServer):
    """A backend on loopback that starts a streamed answer, sends two token chunks and drops the
    connection; counts the requests it took and whether each asked for a stream."""

    def __init__(self) -> None:
        self.streamed: list[bool] = []
        super().__init__()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = orjson.loads(await reader.readexactly(length))
        self.streamed.append(bool(body.get("stream")))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for word in ("Once", " upon"):
            chunk = {
                "id": "cut",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
            }
            event = b"data: " + orjson.dumps(chunk) + b"\n\n"
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
        writer.close()  # cut before the finish chunk, the usage and [DONE]


@pytest.fixture()
def cut_and_good(stub, tmp_path: Path) -> Iterator[tuple[RunningGateway, CuttingUpstream]]:
    up = CuttingUpstream()
    cluster = {"models": {MODEL: {"policy": "round_robin"}}, "breaker": {"failure_threshold": 1000}}
    settings = gateway_settings(stub[0], tmp_path, cluster=cluster)
    model = settings.models[MODEL]
    model.backends = [f"http://127.0.0.1:{up.port}/v1", *model.backends]
    gw = start_gateway(settings)
    yield gw, up
    gw.stop()
    up.stop()


def test_a_whole_answer_is_assembled_from_the_backends_stream(gateway: RunningGateway) -> None:
    key = gateway.new_key("whole-assembled")
    client = gateway.client(key)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "whole-assembled"
    )
    (row,) = gateway.wait_ledger(1, key_id=key_id)
    assert row["status"] == "ok" and row["output_tokens"] == 8
    assert row["uncached_input_tokens"] + row["cached_input_tokens"] == resp.usage.prompt_tokens


def test_a_backend_that_breaks_off_a_whole_answer_is_retried_and_billed_once(cut_and_good) -> None:
    gw, up = cut_and_good
    key = gw.new_key("whole-cut")
    client = gw.client(key)
    answers = [
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"story {i}"}], max_tokens=8
        )
        for i in range(4)
    ]
    assert up.streamed and all(up.streamed)  # the gateway asked the backend for a stream
    assert all(a.usage is not None and a.usage.completion_tokens == 8 for a in answers)
    assert all("Once upon" not in (a.choices[0].message.content or "") for a in answers)
    key_id = next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == "whole-cut")
    rows = gw.wait_ledger(4, key_id=key_id)
    assert len(rows) == 4 and all(r["status"] == "ok" and r["output_tokens"] == 8 for r in rows)
    assert b"tokenops_whole_answer_retries_total" in gw.admin("GET", "/metrics").content


def test_a_streaming_client_sees_the_cut_as_an_error_event(cut_and_good) -> None:
    # a stream already under way cannot be asked again: the client gets the error event
    gw, up = cut_and_good
    key = gw.new_key("stream-cut")
    client = gw.client(key)
    texts, errors = [], 0
    for i in range(2):  # round robin: one of the two goes to the cutting backend
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"s{i}"}], max_tokens=8, stream=True
            )
            texts.append("".join((c.choices[0].delta.content or "") for c in stream if c.choices))
        except Exception:  # noqa: BLE001 - the SDK raises on an error event
            errors += 1
    assert errors == 1 and len(texts) == 1
