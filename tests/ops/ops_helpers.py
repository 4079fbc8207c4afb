"""Small shared helpers for the operations tests."""

from __future__ import annotations

import asyncio
import random

from tokenops.ops.domain import AdmissionRequest, Outcome, TokenUsage
from tokenops.ops.pricing import Price
from tokenops.ops.service import Operations, OpsSettings
from tokenops.protocol import APIError

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
PRICING = {"m1": Price(input=1.0, output=2.0), "free": Price()}


async def open_ops(db_target, **kw) -> Operations:
    url, schema = db_target
    return await Operations.open(OpsSettings(database_url=url, database_schema=schema, **kw), PRICING)


def request(
    prompt=10, max_tokens=10, model="m1", session=None, fingerprint="fp", window=4096
) -> AdmissionRequest:
    return AdmissionRequest(
        model=model,
        prompt_tokens_upper=prompt,
        max_tokens=max_tokens,
        context_window=window,
        session_id=session,
        fingerprint=fingerprint,
    )


def outcome(prompt=10, output=10, cached=0, reasoning=0, model="m1", status="ok") -> Outcome:
    return Outcome(
        model_served=model,
        usage=TokenUsage.from_openai(prompt, output, cached, reasoning),
        status=status,
        finish_reason="stop",
        ttft_ms=5.0,
        latency_ms=20.0,
        http_status=200,
    )


async def budget_race(ops_list, key, n=200):
    """`n` concurrent admit + settle of one key over these Operations; (admitted ids, refusals)."""
    admitted: list[str] = []
    refused = 0

    async def one(i):
        nonlocal refused
        ops = ops_list[i % len(ops_list)]
        p = await ops.authenticate(key)
        try:
            adm = await ops.admit(p, request(prompt=10, max_tokens=10))
        except APIError as e:
            assert e.status == 429 and e.code == "insufficient_quota", e.message
            refused += 1
            return
        admitted.append(adm.id)
        await asyncio.sleep(random.random() * 0.01)
        produced = min(adm.max_output_tokens, random.randint(0, 10))
        await ops.settle(adm, outcome(prompt=10, output=produced))

    await asyncio.gather(*(one(i) for i in range(n)))
    return admitted, refused
