"""The verified semantic cache: a guard-passing candidate is served only once a verifier model, asked
over HTTP with the official openai SDK, says the two questions ask the same thing. The verifier here
is a loopback OpenAI-compatible server standing for the small model: it answers one token with top
log-probabilities, P(yes) high for the pairs it is scripted to call the same."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time

import pytest
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenops.cache import CacheConfig, ResponseCache
from tokenops.cache.verifier import LogprobVerifier, p_yes_from_top

from .conftest import SCOPE, answer, chat

# (cached, asked): the same question in other words
SAME = {
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "What's the capital of France?"),
}
# hard negatives the guards cannot see: another intent in nearly the same words
INTENT_NEGATIVES = [
    ("How do I reset my password?", "How do I choose a strong password?"),
    ("How do I reset my password?", "Why do I have to reset my password?"),
    ("What is the capital of France?", "What is the population of France?"),
]


def verifier_app(seen: list[dict]) -> Starlette:
    async def chat_completions(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        a = prompt.split("Question A: ")[1].split("\n")[0]
        b = prompt.split("Question B: ")[1].split("\n")[0]
        seen.append({"a": a, "b": b, "max_tokens": body["max_tokens"], "top_logprobs": body["top_logprobs"]})
        p = 0.9 if (a, b) in SAME else 0.15
        top = [
            {"token": "Yes", "logprob": math.log(p * 0.8), "bytes": None},
            {"token": " no", "logprob": math.log((1 - p) * 0.8), "bytes": None},
            {"token": "The", "logprob": math.log(0.2), "bytes": None},
        ]
        first = max(top, key=lambda t: t["logprob"])
        return JSONResponse({
            "id": "v", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": first["token"]},
                "logprobs": {"content": [{**first, "top_logprobs": top}]}, "finish_reason": "length",
            }],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 1,
                      "total_tokens": len(prompt.split()) + 1},
        })  # fmt: skip

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])


@pytest.fixture
def verifier_url():
    import uvicorn

    seen: list[dict] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(verifier_app(seen), log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.005)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", seen
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _cache(embedder, clock, url: str, **overrides) -> ResponseCache:
    config = CacheConfig(verifier={"base_url": url, "model": "judge"}, **overrides)
    return ResponseCache(config, embedder=lambda: embedder, clock=clock)


def test_p_yes_reads_yes_and_no_among_the_top_tokens() -> None:
    assert p_yes_from_top([("Yes", math.log(0.6)), (" no", math.log(0.2))]) == pytest.approx(0.75)
    assert p_yes_from_top([("YES.", math.log(0.3)), ("yes", math.log(0.3)), ("No", math.log(0.2))]) == (
        pytest.approx(0.75)
    )
    assert p_yes_from_top([("maybe", -0.1)]) is None


def test_the_verifier_confirms_paraphrases_and_refuses_intent_negatives(
    embedder, clock, verifier_url
) -> None:
    url, seen = verifier_url
    # a low threshold: the intent negatives are close enough to pass the embedding and the guards
    cache = _cache(embedder, clock, url, similarity_threshold=0.5)
    plain = ResponseCache(CacheConfig(similarity_threshold=0.5), embedder=lambda: embedder, clock=clock)

    async def go() -> None:
        for c in (cache, plain):
            for i, stored in enumerate(sorted({a for a, _ in SAME})):
                assert await c.store(SCOPE, chat(stored), answer(f"answer {i}")) is not None
        for stored, asked in sorted(SAME):
            hit = await cache.lookup(SCOPE, chat(asked))
            assert hit is not None and hit.matched_text == stored, asked
        unverified_hits = 0
        for _stored, asked in INTENT_NEGATIVES:
            assert await cache.lookup(SCOPE, chat(asked)) is None, asked
            unverified_hits += await plain.lookup(SCOPE, chat(asked)) is not None
        assert unverified_hits >= 2  # without the verifier these are false hits
        await cache.close()

    asyncio.run(go())
    assert {(s["a"], s["b"]) for s in seen} >= set(INTENT_NEGATIVES) | SAME
    assert all(s["max_tokens"] == 1 and s["top_logprobs"] > 0 for s in seen)
    metrics = generate_latest(cache.metrics.registry).decode()
    assert 'tokenops_cache_verifier_calls_total{verdict="same"} 2.0' in metrics
    assert 'tokenops_cache_guard_vetoes_total{guard="verifier"}' in metrics
    tokens = next(
        line for line in metrics.splitlines() if line.startswith("tokenops_cache_verifier_tokens_total")
    )
    assert float(tokens.split()[-1]) > 0  # its cost is counted


def test_an_unreachable_verifier_is_a_miss_not_an_error(embedder, clock) -> None:
    cache = _cache(embedder, clock, "http://127.0.0.1:9/v1", similarity_threshold=0.5)

    async def go() -> None:
        await cache.store(SCOPE, chat("How do I reset my password?"), answer("a"))
        assert await cache.lookup(SCOPE, chat("How can I reset my password?")) is None
        # the exact layer needs no verifier
        assert await cache.lookup(SCOPE, chat("How do I reset my password?")) is not None
        await cache.close()

    asyncio.run(go())
    metrics = generate_latest(cache.metrics.registry).decode()
    assert 'tokenops_cache_verifier_calls_total{verdict="failed"} 1.0' in metrics


def test_verifier_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_p_yes"):
        LogprobVerifier("http://x/v1", "m", min_p_yes=1.0)
    with pytest.raises(ValueError):
        CacheConfig(verifier={"base_url": "http://x/v1", "model": "m", "max_checks": 0})
