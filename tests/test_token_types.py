"""Every place that lists the token types reads the one definition in `tokenops.token_types`."""

from __future__ import annotations

import dataclasses

from tokenops.config import PriceConfig
from tokenops.ops import models
from tokenops.ops.domain import LedgerRow, TokenUsage
from tokenops.ops.pricing import Price, cost_micros
from tokenops.token_types import COUNTED_TYPES, PRICE_FIELDS, TOKEN_TYPE_NAMES, TOKEN_TYPES


def test_usage_and_ledger_rows_have_one_field_per_type_in_order() -> None:
    assert tuple(f.name for f in dataclasses.fields(TokenUsage)) == TOKEN_TYPE_NAMES
    row_fields = [f.name for f in dataclasses.fields(LedgerRow)]
    assert [n for n in row_fields if n in TOKEN_TYPE_NAMES] == list(TOKEN_TYPE_NAMES)


def test_the_ledger_keeps_its_column_names() -> None:
    # the migrations fix these names: the definition must not rename a column
    assert [t.column for t in TOKEN_TYPES] == [
        "uncached_input_tokens",
        "cached_input_tokens",
        "incremental_prefill_tokens",
        "output_tokens",
        "reasoning_tokens",
    ]
    assert all(not models.ledger.c[t.column].nullable for t in TOKEN_TYPES)


def test_prices_and_the_config_bill_every_type() -> None:
    assert {f.name for f in dataclasses.fields(Price)} == set(PRICE_FIELDS)
    assert set(PriceConfig.model_fields) == set(PRICE_FIELDS)


def test_incremental_prefill_is_a_meter_not_a_share_of_the_tokens() -> None:
    assert [t.name for t in COUNTED_TYPES] == ["uncached_input", "cached_input", "output", "reasoning"]
    usage = TokenUsage(uncached_input=10, cached_input=20, incremental_prefill=30, output=4, reasoning=5)
    assert (usage.prompt_tokens, usage.completion_tokens) == (30, 9)
    # unset cached and reasoning rates take the input and output rates; the meter is a surcharge
    price = Price(input=1.0, output=2.0, incremental_prefill=0.5)
    assert cost_micros(price, usage) == 10 + 20 + 15 + 8 + 10
