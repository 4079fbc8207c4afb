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

    req = parse_request("chat", b'{"model":"a","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":50,"foo":1}', "s1")
    out = orjson.loads(req.upstream_body("served", 10))
    assert out["model"] == "served" and out["max_tokens"] == 10 and out["stream_options"]["include_usage"] is True
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
    assert len(parse_request("completion", orjson.dumps(ids), None).prompt_blocks()[0]) == 2  # 16-token blocks


def test_sse_framing_split_anywhere() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'

    async def collect(step: int) -> list[bytes]:
        async def chunks():
            for i in range(0, len(stream), step):
                yield stream[i : i + step]

        return [d async for d in iter_data(chunks())]

    for step in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(step)) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
