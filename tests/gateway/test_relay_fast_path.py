"""The SSE relay's fast path (`sse.quick_tokens`): plain token chunks are counted without parsing,
and every chunk it does not understand is left to the parser. Checked against the parser's own
reading (`Exchange.observe`'s rule) on the shapes real servers stream, and through a real gateway."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from gateway_harness import MODEL, RunningGateway

from tokenops.gateway.sse import quick_tokens

HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'


def chunk(choices: str, tail: str = "") -> bytes:
    return HEAD + b'"choices":[' + choices.encode() + b"]" + tail.encode() + b"}"


TOKEN_CHUNKS = [
    chunk('{"index":0,"delta":{"content":"the "},"finish_reason":null}'),
    chunk('{"index":0,"delta":{"content":"\\"quoted\\" "},"finish_reason":null}'),
    chunk('{"index":0,"delta":{"content":"says \\"usage\\" and \\"error\\""},"finish_reason":null}'),
    chunk('{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}'),
    chunk('{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}', ',"usage":null'),
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"the ","logprobs":null,"finish_reason":null}]}',
    # pydantic-serialised deltas (SGLang's shape) name every field, unset ones as null
    chunk(
        '{"index":0,"delta":{"role":null,"content":"hi","reasoning_content":null,"tool_calls":null},'
        '"logprobs":null,"finish_reason":null,"matched_stop":null}',
        ',"usage":null',
    ),
]
EMPTY_CHUNKS = [
    chunk('{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}'),
    chunk('{"index":0,"delta":{"content":null},"finish_reason":null}'),
    chunk('{"index":0,"delta":{},"finish_reason":null}'),
]
MUST_PARSE = [
    chunk('{"index":0,"delta":{},"finish_reason":"stop"}'),
    chunk("", ',"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}'),
    chunk('{"index":0,"delta":{"content":"a"},"finish_reason":null}', ',"usage":{"prompt_tokens":3}'),
    chunk(
        '{"index":0,"delta":{"content":"a"},"finish_reason":null},{"index":1,"delta":{"content":"b"},"finish_reason":null}'
    ),
    chunk(
        '{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]},"finish_reason":null}'
    ),
    chunk('{"index":0,"delta":{"content":"a"},"logprobs":{"content":[]},"finish_reason":null}'),
    b'{"error":{"message":"boom","finish_reason":null}}',
    b'{"id": "x", "choices": [{"index": 0, "delta": {"content": "spaced"}, "finish_reason": null}]}',
    b"[1,2]",
    chunk('{"index":0,"delta":{"content":"a","tool_calls":null},"finish_reason":null}', ',"tool_calls":[]'),
    chunk('{"index":0,"delta":{"content":"a"},"finish_reason":null}')[:-1],  # cut off: not one JSON object
]


def parsed_tokens(data: bytes) -> int:
    """What the parser's path (`Exchange.observe`) counts for one chunk."""
    from tokenops.gateway.exchange import Exchange
    from tokenops.gateway.request import parse_request
    from tokenops.gateway.timing import PathTimer, now_ns

    inbound = parse_request(
        "chat",
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        None,
    )
    exchange = Exchange(None, inbound, PathTimer(now_ns()), model_served="m")
    exchange.observe(orjson.loads(data))
    return exchange.content_chunks


@pytest.mark.parametrize("data", TOKEN_CHUNKS + EMPTY_CHUNKS)
def test_plain_chunks_take_the_fast_path_and_count_as_the_parser_does(data: bytes) -> None:
    assert quick_tokens(data) is not None
    assert quick_tokens(data) == parsed_tokens(data) == (1 if data in TOKEN_CHUNKS else 0)


@pytest.mark.parametrize("data", MUST_PARSE)
def test_everything_else_is_left_to_the_parser(data: bytes) -> None:
    assert quick_tokens(data) is None


def test_a_stream_is_billed_the_same_through_the_fast_path(
    gateway: RunningGateway, stub: tuple[str, Any]
) -> None:
    """Without the backend's usage the ledger bills the counted content chunks: the fast path must count
    every token chunk the stub sent before it broke off (6) and relay each one."""
    client = gateway.client(gateway.new_key("fast-path"))
    words: list[str] = []
    stub[1].drop_after = 6  # broken off before the finish and usage chunks
    try:
        with pytest.raises(openai.APIError):
            for c in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=10, stream=True
            ):
                words += (c.choices[0].delta.content or "").split() if c.choices else []
    finally:
        stub[1].drop_after = None
    assert len(words) == 6
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "fast-path"
    )
    (row,) = gateway.wait_ledger(1, key_id=key_id)
    assert row["status"] == "upstream_error" and row["output_tokens"] == 6, row


def _relay_reads(reads: list[bytes]) -> tuple[list[bytes], Any]:
    """Run the relay over `reads` (as a backend's body arrives); the client's writes and the exchange."""
    import asyncio

    from tokenops.gateway.exchange import Exchange
    from tokenops.gateway.request import parse_request
    from tokenops.gateway.sse import relay
    from tokenops.gateway.timing import PathTimer, now_ns

    inbound = parse_request(
        "chat",
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        None,
    )
    exchange = Exchange(None, inbound, PathTimer(now_ns()), model_served="m")
    sent: list[bytes] = []

    async def chunks():
        for r in reads:
            yield r

    async def send(message: dict) -> None:
        sent.append(message["body"])

    asyncio.run(relay(chunks(), send, exchange, lambda: False))
    return sent, exchange


ROLE = chunk('{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}')
FINISH = chunk('{"index":0,"delta":{},"finish_reason":"stop"}')
USAGE = chunk("", ',"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}')


def ev(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def test_a_read_of_one_plain_event_leaves_as_the_same_bytes() -> None:
    tokens = TOKEN_CHUNKS[:3]
    reads = [ev(ROLE), *(ev(t) for t in tokens), ev(FINISH) + ev(USAGE) + b"data: [DONE]\n\n"]
    sent, exchange = _relay_reads(reads)
    # the token reads are written as they were read: the very same bytes objects, not re-framed copies
    assert all(sent[1 + i] is reads[1 + i] for i in range(len(tokens)))
    assert exchange.content_chunks == len(tokens) and exchange.finish_reason == "stop"
    # the usage chunk the gateway asked for on its own account is dropped; the rest arrives in order
    assert sent[-1] == ev(FINISH) + b"data: [DONE]\n\n"


def test_reads_the_fast_path_does_not_take_reach_the_client_as_before() -> None:
    """Two events in one read, an event split across reads, CRLF framing, a finish chunk and a
    non-plain chunk mid-stream: each leaves re-framed by the decoder, every token counted once."""
    a, b, c = TOKEN_CHUNKS[0], TOKEN_CHUNKS[1], TOKEN_CHUNKS[3]
    split = ev(c)
    reads = [
        ev(ROLE),
        ev(a) + ev(b),  # two events
        split[:20],
        split[20:],  # split across reads: the second part finds the decoder holding the first
        (b"data: " + a + b"\r\n\r\n"),  # CRLF
        ev(MUST_PARSE[4]),  # tool calls: parsed
        ev(a),  # plain again, decoder idle
        ev(FINISH) + ev(USAGE) + b"data: [DONE]\n\n",
    ]
    sent, exchange = _relay_reads(reads)
    assert (
        b"".join(sent)
        == b"".join(ev(d) for d in (ROLE, a, b, c, a, MUST_PARSE[4], a, FINISH)) + b"data: [DONE]\n\n"
    )
    assert exchange.content_chunks == 6
    assert sent[-2] is reads[-2]
