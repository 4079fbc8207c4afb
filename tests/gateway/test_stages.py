"""The gateway's stages in isolation: prompt-token upper bound, prompt prefix hashes, SSE framing.
(Priority-ordered waiting for a replica is the cluster pool's; tests/cluster and test_priority.py.)"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tokenops.gateway.request import parse_request
from tokenops.gateway.sse import iter_data
from tokenops.protocol import APIError


def test_prompt_bound_is_never_below_a_real_tokenizer() -> None:
    # a byte-level BPE with no merges is the worst case: one token per UTF-8 byte
    texts = ["hello world", "日本語のテキスト", "emoji 🎉🎉 and accents éèê", "x" * 1000]
    body = {"model": "m", "messages": [{"role": "user", "content": t} for t in texts]}
    import orjson

    req = parse_request("chat", orjson.dumps(body), None)
    worst = sum(len(t.encode()) for t in texts)
    assert req.prompt_tokens_upper(0) >= worst
    assert req.prompt_tokens_estimate() <= req.prompt_tokens_upper(0)


def test_parse_errors_are_400_with_the_field() -> None:
    with pytest.raises(APIError) as e:
        parse_request("chat", b"{not json", None)
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(APIError) as e:
        parse_request("chat", b'{"model": "m", "messages": "hi"}', None)
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(APIError) as e:
        parse_request("completion", b'{"model": "m"}', None)
    assert e.value.code == "missing_required_parameter"
    for prompt in ("[9223372036854775808]", "[[1, -1]]"):  # beyond int64 broke prefix hashing (a 500)
        with pytest.raises(APIError) as e:
            parse_request("completion", b'{"model": "m", "prompt": %s}' % prompt.encode(), None)
        assert e.value.status == 400 and e.value.param == "prompt" and "token ids" in e.value.message


def test_upstream_body_caps_max_tokens_and_asks_usage() -> None:
    import orjson

    req = parse_request(
        "chat",
        b'{"model":"a","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":50,"foo":1}',
        "s1",
    )
    out = orjson.loads(req.upstream_body("served", 10))
    assert (
        out["model"] == "served"
        and out["max_tokens"] == 10
        and out["stream_options"]["include_usage"] is True
    )
    assert out["foo"] == 1 and req.session_id == "s1" and not req.client_wants_usage


def test_prompts_sharing_a_system_prompt_share_leading_block_hashes() -> None:
    system = {"role": "system", "content": "You are a terse assistant for the ACME help desk. " * 8}

    def hashes(question: str) -> tuple[int, ...]:
        body = {"model": "m", "messages": [system, {"role": "user", "content": question}]}
        hashes, block_tokens = parse_request("chat", orjson.dumps(body), None).prompt_blocks()
        assert block_tokens == 16  # 64 characters stand for about 16 tokens
        return hashes

    a, b = hashes("How do I reset my password? " * 4), hashes("Where is my invoice for March? " * 4)
    shared = len(system["content"]) // 64
    assert shared >= 5 and a[:shared] == b[:shared] and a != b
    other = {"model": "m", "messages": [{"role": "system", "content": "Another prompt entirely. " * 20}]}
    assert parse_request("chat", orjson.dumps(other), None).prompt_blocks()[0][0] != a[0]
    ids = {"model": "m", "prompt": list(range(40))}
    assert (
        len(parse_request("completion", orjson.dumps(ids), None).prompt_blocks()[0]) == 2
    )  # 16-token blocks


def test_sse_framing_split_anywhere() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'

    async def collect(step: int) -> list[bytes]:
        async def chunks():
            for i in range(0, len(stream), step):
                yield stream[i : i + step]

        return [d async for d in iter_data(chunks())]

    for step in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(step)) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


async def relay_to_client(chunks, send, receive, exchange) -> None:
    """The relay as the gateway runs it: in the caller's task, under a `ClientWatch` that ends it at
    once when the client goes away (the exchange is then marked `client_disconnected`)."""
    from tokenops.gateway.client_watch import ClientWatch
    from tokenops.gateway.sse import relay

    async with ClientWatch(receive) as watch:
        await relay(chunks, send, exchange, watch.client_gone)
    if watch.gone:
        exchange.fail("client_disconnected", 499, "client_disconnected")


def _relay_case(client_leaves_after: int | None, backend_ends: bool) -> tuple[str, list[bytes], int]:
    """Relay a backend stream to a fake client in the caller's task; returns the exchange's status,
    what the client got, and the task's pending cancellations once the caller has awaited again."""
    from tokenops.gateway.exchange import Exchange
    from tokenops.gateway.timing import PathTimer, now_ns

    event = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'

    async def main() -> tuple[str, list[bytes], int]:
        inbound = parse_request(
            "chat",
            orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
            None,
        )
        exchange = Exchange(None, inbound, PathTimer(now_ns()), model_served="m")
        sent: list[bytes] = []
        gone = asyncio.Event()

        async def chunks():
            for _ in range(3):
                yield event
            if backend_ends:
                yield b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
            else:
                await asyncio.Event().wait()  # a backend that stalls: only a disconnect ends the read

        async def send(message: dict) -> None:
            sent.append(message["body"])
            if len(sent) == client_leaves_after or not message["more_body"]:
                gone.set()  # uvicorn reports a disconnect once the response is complete, too

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        await relay_to_client(chunks(), send, receive, exchange)
        await asyncio.sleep(0.01)  # the watcher's callback, if any, has run: it must not cancel us
        return exchange.status, sent, asyncio.current_task().cancelling()

    return asyncio.run(main())


def test_relay_ends_when_the_client_goes_away_and_leaves_the_task_usable() -> None:
    status, sent, pending = _relay_case(client_leaves_after=2, backend_ends=False)
    # the reads already in hand may still leave before the watcher runs; the closing events never do
    assert status == "client_disconnected" and pending == 0
    assert len(sent) >= 2 and not any(b"[DONE]" in body for body in sent)


def test_relay_to_the_end_is_not_cancelled_by_the_late_disconnect() -> None:
    status, sent, pending = _relay_case(client_leaves_after=None, backend_ends=True)
    assert status == "ok" and sent[-1].endswith(b"data: [DONE]\n\n") and pending == 0


def test_a_cancelled_gateway_task_is_not_taken_for_a_disconnect() -> None:
    from tokenops.gateway.exchange import Exchange
    from tokenops.gateway.timing import PathTimer, now_ns

    async def main() -> None:
        inbound = parse_request(
            "chat",
            orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
            None,
        )
        exchange = Exchange(None, inbound, PathTimer(now_ns()), model_served="m")

        async def chunks():
            await asyncio.Event().wait()
            yield b""

        async def send(message: dict) -> None:
            pass

        async def receive() -> dict:
            await asyncio.Event().wait()
            return {}

        task = asyncio.ensure_future(relay_to_client(chunks(), send, receive, exchange))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
