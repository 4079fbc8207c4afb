"""Budget race through HTTP: 200 concurrent requests against a budget that fits far fewer; the
committed spend never exceeds it, and the refused get a 429 `insufficient_quota`."""

from __future__ import annotations

import asyncio

import openai
from gateway_harness import MODEL, RunningGateway

BUDGET = 1_000  # micro-units: each request costs ~18 (2 input tokens at 1, 8 output tokens at 2)


def test_concurrent_requests_never_overspend(gateway: RunningGateway) -> None:
    key = gateway.new_key("race", {"budget_micros": BUDGET, "budget_period": "total"}, org="race-org")
    key_id = next(k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "race")

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=8, stream=i % 2 == 0
            )
            return "ok"
        except openai.RateLimitError as e:
            return e.code or "429"

    async def run() -> list[str]:
        async with gateway.async_client(key) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    ok = results.count("ok")
    assert 0 < ok < 200 and results.count("insufficient_quota") > 0, results
    rows = gateway.wait_ledger(ok, key_id=key_id)
    spent = sum(r["cost_micros"] for r in rows)
    assert spent <= BUDGET
    assert len(rows) == ok  # one ledger row per admitted request, none for the refused
