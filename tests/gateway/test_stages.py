"""The gateway's stages in isolation: prompt-token upper bound, the priority queue, SSE framing."""

from __future__ import annotations

import asyncio

import pytest

from tokenops.config import PriorityClass, QueueConfig
from tokenops.gateway.queue import Backend, BackendQueue
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


def test_upstream_body_caps_max_tokens_and_asks_usage() -> None:
    import orjson

    req = parse_request("chat", b'{"model":"a","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":50,"foo":1}', "s1")
    out = orjson.loads(req.upstream_body("served", 10))
    assert out["model"] == "served" and out["max_tokens"] == 10 and out["stream_options"]["include_usage"] is True
    assert out["foo"] == 1 and req.session_id == "s1" and not req.client_wants_usage


def test_queue_serves_higher_classes_first_and_refuses_lower_ones() -> None:
    async def scenario() -> None:
        cfg = QueueConfig(classes=[PriorityClass(max_wait_s=5, max_queued=10), PriorityClass(max_wait_s=5, max_queued=1)])
        q = BackendQueue("m", [Backend("http://x/v1", "m", None, max_inflight=1)], cfg)
        held = await q.acquire(0)
        order: list[str] = []

        async def take(p: int, name: str) -> None:
            b = await q.acquire(p)
            order.append(name)
            q.release(b)

        low = asyncio.ensure_future(take(1, "low"))
        await asyncio.sleep(0)
        high = asyncio.ensure_future(take(0, "high"))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as e:  # class 1's line holds one waiter
            await q.acquire(1)
        assert e.value.status == 429 and e.value.code == "backend_busy" and "retry-after" in e.value.headers
        q.release(held)
        await asyncio.gather(low, high)
        assert order == ["high", "low"]
        assert q.backends[0].inflight == 0 and q.waiting() == 0

    asyncio.run(scenario())


def test_queue_wait_times_out_with_429() -> None:
    async def scenario() -> None:
        cfg = QueueConfig(classes=[PriorityClass(max_wait_s=0.05, max_queued=10)])
        q = BackendQueue("m", [Backend("http://x/v1", "m", None, max_inflight=1)], cfg)
        await q.acquire(0)
        with pytest.raises(APIError, match="no slot freed"):
            await q.acquire(0)
        assert q.waiting() == 0

    asyncio.run(scenario())


def test_sse_framing_split_anywhere() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'

    async def collect(step: int) -> list[bytes]:
        async def chunks():
            for i in range(0, len(stream), step):
                yield stream[i : i + step]

        return [d async for d in iter_data(chunks())]

    for step in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(step)) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
