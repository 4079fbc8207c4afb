"""Budget race through HTTP: 200 concurrent requests against a budget that fits far fewer; the
committed spend never exceeds it, and the refused get a 429 `insufficient_quota`."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
import sqlalchemy as sa
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BUDGET = 1_000  # micro-units: each request costs ~18 (2 input tokens at 1, 8 output tokens at 2)


def test_concurrent_requests_never_overspend(gateway: RunningGateway) -> None:
    key = gateway.new_key("race", {"budget_micros": BUDGET, "budget_period": "total"}, org="race-org")
    key_id = next(k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "race")

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=8,
                stream=i % 2 == 0,
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


@pytest.mark.postgres
def test_concurrent_requests_never_overspend_on_postgresql(stub, tmp_path) -> None:
    schema = f"t_gw_{uuid.uuid4().hex[:12]}"
    settings = gateway_settings(stub[0], tmp_path, database_url=PG_URL, database_schema=schema)
    gw = start_gateway(settings)
    try:
        test_concurrent_requests_never_overspend(gw)
    finally:
        gw.stop()
        engine = sa.create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
