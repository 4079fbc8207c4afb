import pytest

from tokenops.ops.domain import TokenUsage
from tokenops.ops.pricing import Price, cost_micros, output_tokens_affordable, parse_price, worst_case_micros


def test_price_per_million_is_micros_per_token():
    p = Price(input=2.0, output=8.0)
    assert cost_micros(p, TokenUsage(uncached_input=1_000_000)) == 2_000_000
    assert cost_micros(p, TokenUsage(uncached_input=10, output=5)) == 60


def test_defaults_and_overrides_per_type():
    p = Price(input=1.0, output=4.0)
    assert cost_micros(p, TokenUsage(cached_input=10, reasoning=10)) == 10 + 40
    q = Price(input=1.0, cached_input=0.1, output=4.0, reasoning=2.0, incremental_prefill=0.5)
    u = TokenUsage(uncached_input=100, cached_input=900, incremental_prefill=100, output=10, reasoning=20)
    assert cost_micros(q, u) == 100 + 90 + 50 + 40 + 40


def test_rounds_up_once_and_exact_decimals_do_not_overbill():
    p = Price(input=0.1, output=0.0)
    assert cost_micros(p, TokenUsage(uncached_input=3)) == 1  # 0.3 -> 1
    assert cost_micros(p, TokenUsage(uncached_input=30)) == 3  # not 4 from float noise
    assert cost_micros(Price(), TokenUsage(uncached_input=10**9)) == 0


def test_worst_case_bounds_every_split():
    p = Price(input=1.0, cached_input=3.0, output=2.0, reasoning=5.0)
    bound = worst_case_micros(p, 100, 50)
    for cached in (0, 50, 100):
        for reasoning in (0, 25, 50):
            u = TokenUsage.from_openai(100, 50, cached, reasoning)
            assert cost_micros(p, u) <= bound


def test_output_tokens_affordable():
    p = Price(input=1.0, output=2.0)
    assert output_tokens_affordable(p, 100, 100) == 0
    assert output_tokens_affordable(p, 100, 99) == 0
    assert output_tokens_affordable(p, 100, 151) == 25
    assert worst_case_micros(p, 100, output_tokens_affordable(p, 100, 151)) <= 151


def test_from_openai_splits_reasoning_and_cache():
    u = TokenUsage.from_openai(prompt_tokens=100, completion_tokens=40, cached_tokens=60, reasoning_tokens=30)
    assert (u.uncached_input, u.cached_input, u.output, u.reasoning) == (40, 60, 10, 30)
    assert u.prompt_tokens == 100 and u.completion_tokens == 40


def test_parse_price_and_validation():
    assert parse_price({"input": 1, "output": "2.5"}) == Price(input=1.0, output=2.5)
    with pytest.raises(ValueError, match="unknown price field"):
        parse_price({"inptu": 1})
    with pytest.raises(ValueError):
        Price(input=-1)
