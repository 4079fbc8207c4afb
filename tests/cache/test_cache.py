"""The cache façade with the real MiniLM embedder: hard negatives never hit, paraphrases do, exact
hits, TTL, the memory bound's eviction order, store rules, false-hit reports and metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from tokenops.cache import CacheDirective, CacheScope, assemble_stream, directive_from_headers

from .conftest import SCOPE, answer, chat


def run(coro):
    return asyncio.run(coro)


async def _seed(cache, request, text="A", scope=SCOPE):
    assert await cache.store(scope, request, answer(text)) is not None


def test_exact_hit_and_headers(make_cache):
    cache = make_cache(semantic=False)

    async def go():
        assert await cache.lookup(SCOPE, chat("What is 2+2?")) is None
        await _seed(cache, chat("What is 2+2?"), "4")
        hit = await cache.lookup(SCOPE, chat("What is 2+2?", stream=True))
        assert hit is not None and hit.layer == "exact" and hit.similarity == 1.0
        assert hit.body["choices"][0]["message"]["content"] == "4"
        assert dict(hit.headers())[b"x-tokenops-cache"] == b"hit-exact"
        body = hit.completion("chatcmpl-new")
        assert body["id"] == "chatcmpl-new" and body["usage"]["completion_tokens"] == 3

    run(go())


PARAPHRASES = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "What's the capital of France?"),
    ("Explain how photosynthesis works.", "Can you explain how photosynthesis works?"),
    ("How many miles is 10 kilometers?", "How many miles are in 10 kilometers?"),
    ("Give me a recipe for pancakes without eggs", "Give me a pancake recipe without eggs"),
]

HARD_NEGATIVES = [
    ("How many miles is 10 kilometers?", "How many miles is 15 kilometers?"),  # number
    ("How many miles is 10 kilometers?", "How many miles is ten kilometers and 5 meters?"),  # number
    ("Give me a recipe for pancakes without eggs", "Give me a recipe for pancakes with eggs"),  # negation
    ("Is it safe to drink tap water in Mexico?", "Is it not safe to drink tap water in Mexico?"),  # negation
    ("What is the capital of France?", "What is the capital of Spain?"),  # entity
    ("Write a short biography of Marie Curie", "Write a short biography of Albert Einstein"),  # entity
]


def test_paraphrases_hit(make_cache):
    cache = make_cache()

    async def go():
        for i, (a, _) in enumerate(PARAPHRASES):
            await _seed(cache, chat(a), f"answer {i}")
        for i, (a, b) in enumerate(PARAPHRASES):
            hit = await cache.lookup(SCOPE, chat(b))
            assert hit is not None, f"paraphrase missed: {b!r}"
            assert hit.layer == "semantic" and hit.matched_text == a
            assert hit.body["choices"][0]["message"]["content"] == f"answer {i}"

    run(go())


@pytest.mark.parametrize(("stored", "asked"), HARD_NEGATIVES)
def test_hard_negatives_never_hit(make_cache, stored, asked):
    # a threshold far below the default: only the guards stand between these and a false hit
    cache = make_cache(similarity_threshold=0.5)

    async def go():
        await _seed(cache, chat(stored))
        assert await cache.lookup(SCOPE, chat(asked)) is None

    run(go())


def test_scope_negatives_never_hit(make_cache):
    cache = make_cache(similarity_threshold=0.5)
    q = "What is the capital of France?"
    history = [
        {"role": "user", "content": "Let's talk about Canada."},
        {"role": "assistant", "content": "Sure."},
    ]
    others = [
        (CacheScope("globex", "m"), chat(q)),  # tenant
        (CacheScope("acme", "other-model"), chat(q)),  # model
        (SCOPE, chat(q, system="Answer in French.")),  # system prompt
        (SCOPE, chat(q, history=history)),  # earlier turns
        (SCOPE, chat(q, tools=[{"type": "function", "function": {"name": "lookup", "parameters": {}}}])),
        (SCOPE, chat(q, max_tokens=3)),  # sampling params
        (SCOPE, chat(q, temperature=0, seed=1)),
        (SCOPE, chat(q, temperature=0, top_p=0.1)),
    ]

    async def go():
        await _seed(cache, chat(q))
        for scope, request in others:
            assert await cache.lookup(scope, request) is None, request.body
        # the control: the same request in the same scope does hit
        assert await cache.lookup(SCOPE, chat(q)) is not None

    run(go())


def test_sampled_requests_bypass_unless_opted_in(make_cache):
    cache = make_cache(sampled_tenants=["initech"])

    async def go():
        hot = chat("Tell me a joke", temperature=0.8)
        assert await cache.store(SCOPE, hot, answer("joke")) is None
        assert await cache.lookup(SCOPE, hot) is None
        opt = CacheDirective(allow_sampled=True)
        assert await cache.store(SCOPE, hot, answer("joke"), opt) is not None
        assert await cache.lookup(SCOPE, hot, opt) is not None
        assert await cache.lookup(SCOPE, hot) is None  # without the opt-in, still bypassed
        tenant = CacheScope("initech", "m")
        await _seed(cache, hot, scope=tenant)
        assert await cache.lookup(tenant, hot) is not None

    run(go())
    text = generate_latest(cache.metrics.registry).decode()
    assert 'tokenops_cache_bypasses_total{reason="sampled"} 2.0' in text


def test_client_directives(make_cache):
    cache = make_cache(semantic=False)

    async def go():
        r = chat("hello there")
        assert await cache.store(SCOPE, r, answer("hi"), directive_from_headers("no-store")) is None
        await _seed(cache, r)
        assert await cache.lookup(SCOPE, r, directive_from_headers("no-cache")) is None
        assert await cache.lookup(SCOPE, r) is not None

    run(go())


def test_ttl_expiry(make_cache, clock):
    cache = make_cache(ttl_s=60)

    async def go():
        await _seed(cache, chat("What is the boiling point of water?"))
        clock.t += 59
        assert await cache.lookup(SCOPE, chat("What is the boiling point of water?")) is not None
        assert await cache.lookup(SCOPE, chat("What's the boiling point of water?")) is not None
        clock.t += 2
        assert await cache.lookup(SCOPE, chat("What is the boiling point of water?")) is None
        assert await cache.lookup(SCOPE, chat("What's the boiling point of water?")) is None
        assert await cache.index.size() == (0, 0)

    run(go())


def test_lru_eviction_by_entries(make_cache):
    cache = make_cache(semantic=False, max_entries=3)

    async def go():
        for q in ("q1", "q2", "q3"):
            await _seed(cache, chat(q))
        assert await cache.lookup(SCOPE, chat("q1")) is not None  # q1 is now the most recent
        await _seed(cache, chat("q4"))  # evicts the least recently used: q2
        present = [q for q in ("q1", "q2", "q3", "q4") if await cache.lookup(SCOPE, chat(q)) is not None]
        assert present == ["q1", "q3", "q4"]

    run(go())
    assert (
        'tokenops_cache_evictions_total{reason="capacity"} 1.0'
        in generate_latest(cache.metrics.registry).decode()
    )


def test_lru_eviction_by_bytes(make_cache):
    cache = make_cache(semantic=False, max_bytes=8 * 1024)

    async def go():
        big = "x" * 3000
        for q in ("a", "b", "c"):
            await cache.store(SCOPE, chat(q), answer(big))
        n, b = await cache.index.size()
        assert n == 2 and b <= 8 * 1024
        assert await cache.lookup(SCOPE, chat("a")) is None
        assert await cache.lookup(SCOPE, chat("c")) is not None

    run(go())


def test_store_rules(make_cache):
    cache = make_cache(semantic=False, max_response_bytes=2000)

    async def go():
        r = chat("hi")
        assert await cache.store(SCOPE, r, answer("x", finish="content_filter")) is None
        assert await cache.store(SCOPE, r, {"error": {"message": "nope"}}) is None
        assert await cache.store(SCOPE, r, answer("y" * 3000)) is None
        assert await cache.store(SCOPE, r, b"not json") is None
        assert await cache.store(SCOPE, r, answer("ok", finish="length")) is not None
        # the newer answer to the same request replaces the older
        await cache.store(SCOPE, r, answer("newer"))
        assert (await cache.index.size())[0] == 1
        assert (await cache.lookup(SCOPE, r)).body["choices"][0]["message"]["content"] == "newer"

    run(go())


def test_long_prompts_use_the_exact_layer_only(make_cache):
    cache = make_cache(similarity_threshold=0.5)
    long_a = "Summarise this report. " + "The quarterly figures were broadly in line. " * 60 + "Revenue grew."
    long_b = "Summarise this report. " + "The quarterly figures were broadly in line. " * 60 + "Revenue fell."

    async def go():
        await _seed(cache, chat(long_a))
        assert await cache.lookup(SCOPE, chat(long_b)) is None  # identical first 256 word pieces
        assert (await cache.lookup(SCOPE, chat(long_a))).layer == "exact"

    run(go())


def test_false_hit_report(make_cache):
    cache = make_cache()

    async def go():
        await _seed(cache, chat("How do I reset my password?"))
        hit = await cache.lookup(SCOPE, chat("How can I reset my password?"))
        assert hit is not None
        assert not await cache.report_false_hit(hit.hit_id, "globex")  # not the tenant's entry
        assert not await cache.report_false_hit("s.bogus", "acme")
        assert await cache.report_false_hit(hit.hit_id, "acme")
        assert await cache.lookup(SCOPE, chat("How can I reset my password?")) is None  # dropped

    run(go())
    text = generate_latest(cache.metrics.registry).decode()
    assert 'tokenops_cache_false_hits_total{layer="semantic"} 1.0' in text
    assert "tokenops_cache_false_hit_ratio 1.0" in text
    assert 'tokenops_cache_hits_total{layer="semantic"} 1.0' in text
    assert "tokenops_cache_lookups_total 2.0" in text


def test_guard_vetoes_are_counted(make_cache):
    cache = make_cache(similarity_threshold=0.5)

    async def go():
        await _seed(cache, chat("Convert 5 miles to kilometers"))
        assert await cache.lookup(SCOPE, chat("Convert 50 miles to kilometers")) is None

    run(go())
    assert (
        'tokenops_cache_guard_vetoes_total{guard="numbers"} 1.0'
        in generate_latest(cache.metrics.registry).decode()
    )


def test_stream_roundtrip(make_cache):
    cache = make_cache(semantic=False)
    original = answer("Hello world")
    original["choices"][0]["message"]["tool_calls"] = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]

    async def go():
        await cache.store(SCOPE, chat("hi"), original)
        hit = await cache.lookup(SCOPE, chat("hi"))
        chunks = hit.chunks(include_usage=True, response_id="chatcmpl-x")
        assert chunks[-1]["usage"] == original["usage"] and chunks[-1]["choices"] == []
        rebuilt = assemble_stream(chunks)
        assert rebuilt["choices"] == original["choices"] and rebuilt["id"] == "chatcmpl-x"

    run(go())


def test_assemble_streamed_deltas():
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {**base, "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ]
    body = assemble_stream(chunks)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["total_tokens"] == 5
    text = [
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": t, "finish_reason": f}],
        }
        for t, f in (("a", None), ("b", "length"))
    ]
    assert assemble_stream(text)["choices"][0]["text"] == "ab"
    assert assemble_stream([]) is None


def test_missing_embedder_leaves_the_exact_layer(clock):
    from tokenops.cache import CacheConfig, ResponseCache

    def broken():
        raise RuntimeError("no model files")

    cache = ResponseCache(CacheConfig(), embedder=broken, clock=clock)

    async def go():
        await _seed(cache, chat("How do I reset my password?"))
        assert (await cache.lookup(SCOPE, chat("How do I reset my password?"))).layer == "exact"
        assert await cache.lookup(SCOPE, chat("How can I reset my password?")) is None

    run(go())


def test_gateway_inbound_request_fits(make_cache):
    """The gateway passes its parsed `InboundRequest` as is (it has .kind and .body)."""
    import orjson

    from tokenops.gateway.request import parse_request

    cache = make_cache()
    body = {
        "model": "m",
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "What is the capital of Peru?"}],
    }
    inbound = parse_request("chat", orjson.dumps(body), None)
    para = dict(
        body, stream=False, messages=[{"role": "user", "content": "What's the capital city of Peru?"}]
    )

    async def go():
        assert await cache.store(SCOPE, inbound, answer("Lima")) is not None
        hit = await cache.lookup(SCOPE, parse_request("chat", orjson.dumps(para), None))
        assert hit is not None and hit.layer == "semantic"
        text = parse_request(
            "completion", orjson.dumps({"model": "m", "prompt": "Once upon a time", "temperature": 0}), None
        )
        await cache.store(
            SCOPE,
            text,
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": " there", "finish_reason": "length"}],
            },
        )
        assert (await cache.lookup(SCOPE, text)).body["choices"][0]["text"] == " there"

    run(go())
