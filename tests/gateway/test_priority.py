"""Priority classes through HTTP: with the backend at its in-flight cap, a class-0 request waits for
the slot while the lowest class is refused first (its line is short and its wait brief)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway


@pytest.fixture(scope="module")
def busy_gateway(stub: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    settings = gateway_settings(
        stub[0],
        tmp_path_factory.mktemp("prio"),
        queue={
            "classes": [
                {"max_wait_s": 20, "max_queued": 10},
                {"max_wait_s": 20, "max_queued": 10},
                {"max_wait_s": 0.3, "max_queued": 1},
            ]
        },
    )
    settings.models[MODEL].max_inflight = 1
    gw = start_gateway(settings)
    yield gw
    gw.stop()


def test_lowest_class_is_refused_first(busy_gateway: RunningGateway, stub: tuple[str, Any]) -> None:
    gw = busy_gateway
    high = gw.new_key("high", {"priority": 0})
    low = gw.new_key("low", {"priority": 2})
    stub[1].itl_s = 0.1  # 8 tokens: the one slot stays busy for about 0.8 s

    async def ask(key: str) -> str:
        async with gw.async_client(key) as client:
            try:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
                )
                return "ok"
            except openai.RateLimitError as e:
                assert e.response.headers.get("retry-after")
                return e.code or "429"

    async def scenario() -> list[str]:
        holder = asyncio.ensure_future(ask(high))  # takes the only slot
        await asyncio.sleep(0.3)
        waiting_high = asyncio.ensure_future(ask(high))  # class 0: waits for the slot
        await asyncio.sleep(0.05)
        low_first = asyncio.ensure_future(ask(low))  # class 2: queues (line of one), gives up after 0.3 s
        await asyncio.sleep(0.05)
        low_second = await ask(low)  # class 2's line is full: refused at once
        return [await holder, await waiting_high, await low_first, low_second]

    try:
        results = asyncio.run(scenario())
    finally:
        stub[1].itl_s = 0.0
    assert results == ["ok", "ok", "backend_busy", "backend_busy"]
    low_id = next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == "low")
    rows = gw.wait_ledger(2, key_id=low_id)
    assert [r["http_status"] for r in rows] == [429, 429] and all(r["cost_micros"] == 0 for r in rows)
