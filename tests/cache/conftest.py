"""Fixtures for the cache tests: one real MiniLM embedder per session, a movable clock, request
builders, and a unique Redis key prefix per test (its keys deleted afterwards)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from tokenops.cache import BodyRequest, CacheConfig, CacheScope, ResponseCache

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def embedder():
    from tokenops.embeddings import shared_embedder

    return shared_embedder()


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def chat(
    text: str, *, system: str | None = "You are helpful.", history: list[dict] | None = None, **params: Any
) -> BodyRequest:
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages += history or []
    messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {"model": "m", "messages": messages, "temperature": 0}
    body.update(params)
    return BodyRequest("chat", body)


def answer(text: str, finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


SCOPE = CacheScope(tenant="acme", model="m")


@pytest.fixture
def make_cache(embedder, clock):
    made: list[ResponseCache] = []

    def make(**overrides: Any) -> ResponseCache:
        c = ResponseCache(CacheConfig(**overrides), embedder=lambda: embedder, clock=clock)
        made.append(c)
        return c

    yield make
    for c in made:
        asyncio.run(c.close())


@pytest.fixture
def redis_prefix():
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception:
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    prefix = f"t_cache:{uuid.uuid4().hex[:10]}"
    yield prefix
    keys = list(client.scan_iter(match=prefix + ":*"))
    if keys:
        client.delete(*keys)
    client.close()
