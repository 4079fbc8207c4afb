"""A request answered by several models (a fusion cascade or ensemble): admitted at a price that
covers every step, settled as one ledger row whose tokens and cost are the sums of all its calls,
each call at its own model's price."""

import asyncio
import dataclasses

import pytest
from ops_helpers import open_ops, outcome, request
from sqlalchemy import select

from tokenops.ops import models as m
from tokenops.ops.domain import ModelCall, TokenUsage
from tokenops.ops.pricing import Price
from tokenops.protocol import APIError

# m1 costs 1 / 2 per input / output token; "big" 10 / 20; a cascade m1 -> big reserves at 11 / 22
BIG = Price(input=10.0, output=20.0)
CASCADE = Price(input=11.0, output=22.0)


def test_side_calls_are_billed_at_their_own_price_in_one_row(db_target):
    async def main():
        ops = await open_ops(db_target)
        ops.pricing["big"] = BIG
        try:
            await ops.create_node(None, "org", {"budget_micros": 10_000, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {"tpm": 1000})
            p = await ops.authenticate(key)
            adm = await ops.admit(
                p, dataclasses.replace(request(prompt=10, max_tokens=10, model="big"), price=CASCADE)
            )
            assert adm.reserved_micros == 10 * 11 + 10 * 22  # both steps' worst case
            # the cheap answer (10 in, 4 out) was rejected; big answered (10 in, 6 out)
            out = dataclasses.replace(
                outcome(prompt=10, output=6, model="big"),
                side_calls=[ModelCall("m1", TokenUsage.from_openai(10, 4))],
            )
            row = await ops.settle(adm, out)
            assert row.model_served == "big"
            assert (row.uncached_input, row.output) == (20, 10)
            assert row.cost_micros == (10 * 10 + 6 * 20) + (10 * 1 + 4 * 2)
            with ops.db.engine.connect() as conn:
                spent = conn.execute(
                    select(m.budget_usage.c.spent_micros, m.budget_usage.c.reserved_micros)
                ).all()
            assert spent == [(row.cost_micros, 0)]
        finally:
            await ops.close()

    asyncio.run(main())


def test_a_budget_below_every_steps_worst_case_is_refused(db_target):
    async def main():
        ops = await open_ops(db_target)
        try:
            # one output token after a 10-token prompt: 32 micro-units for m1 alone,
            # 10 x 11 + 22 = 132 for the cascade
            await ops.create_node(None, "org", {"budget_micros": 100, "budget_period": "total"})
            key, _ = await ops.create_key("org", "k", {})
            p = await ops.authenticate(key)
            with pytest.raises(APIError) as refused:
                await ops.admit(p, dataclasses.replace(request(prompt=10, max_tokens=10), price=CASCADE))
            assert refused.value.code == "insufficient_quota" and "needs 132" in refused.value.message
            adm = await ops.admit(p, request(prompt=10, max_tokens=10))  # m1 alone fits
            assert adm.reserved_micros == 30 and not adm.budget_limited
        finally:
            await ops.close()

    asyncio.run(main())
