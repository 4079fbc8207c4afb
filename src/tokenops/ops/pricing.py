"""Prices per million tokens per token type, and the cost of a request in integer micro-units.

A price of P currency units per million tokens is exactly P micro-units per token, so a request's
cost is the sum over token types of tokens x price, rounded up once to a whole micro-unit (never
under-billed, and the same function bounds a reservation from above). This module knows nothing of
budgets or keys; it only turns token counts into money.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenops.ops.domain import TokenUsage
from tokenops.token_types import PRICE_FIELDS, TOKEN_TYPES, TokenType


@dataclass(frozen=True)
class Price:
    """Currency units per million tokens; `None` means "same as input" / "same as output"."""

    input: float = 0.0
    cached_input: float | None = None
    output: float = 0.0
    reasoning: float | None = None
    # surcharge on the incremental-prefill meter (those tokens are already billed as input)
    incremental_prefill: float = 0.0

    def __post_init__(self) -> None:
        for name in PRICE_FIELDS:
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"price '{name}' must be a finite number >= 0, got {value!r}")

    def rate(self, token_type: TokenType) -> float:
        """The rate per million tokens of `token_type`: its own, or its fallback's while unset."""
        own = getattr(self, token_type.price_field)
        return getattr(self, token_type.price_fallback) if own is None else own

    @property
    def max_input_rate(self) -> float:
        """The dearest rate an input token can be billed at (for worst-case reservations): the dearest
        share of the prompt plus the meters over it."""
        return max(self.rate(t) for t in _PROMPT_SHARES) + sum(self.rate(t) for t in _PROMPT_METERS)

    @property
    def max_output_rate(self) -> float:
        return max(self.rate(t) for t in _COMPLETION_SHARES)


_PROMPT_SHARES = tuple(t for t in TOKEN_TYPES if t.part == "prompt" and t.counted)
_PROMPT_METERS = tuple(t for t in TOKEN_TYPES if t.part == "prompt" and not t.counted)
_COMPLETION_SHARES = tuple(t for t in TOKEN_TYPES if t.part == "completion")


FREE = Price()


def price_table(rates: Mapping[str, Mapping[str, float | None]]) -> dict[str, Price]:
    """A price per model from its rates per million tokens (the config's `pricing:` blocks)."""
    return {model: parse_price(dict(r)) for model, r in rates.items()}


def _ceil_micros(value: float) -> int:
    # float sums of decimal prices carry tiny errors (0.1*3 = 0.30000000000000004): round to a
    # nano-unit first so an exact price does not bill one micro-unit too many
    return math.ceil(round(value, 3))


def cost_micros(price: Price, usage: TokenUsage) -> int:
    """The cost of `usage` at `price`, in micro-units, rounded up."""
    return _ceil_micros(sum(getattr(usage, t.name) * price.rate(t) for t in TOKEN_TYPES))


def worst_case_micros(price: Price, prompt_tokens: int, output_tokens: int) -> int:
    """An upper bound on the cost of a request of at most these many prompt and output tokens."""
    return _ceil_micros(prompt_tokens * price.max_input_rate + output_tokens * price.max_output_rate)


def output_tokens_affordable(price: Price, prompt_tokens: int, micros: int) -> int:
    """How many output tokens `micros` pays for after a worst-case prompt (no upper cap)."""
    rest = micros - worst_case_micros(price, prompt_tokens, 0)
    if rest < 0:
        return 0
    if price.max_output_rate <= 0:
        return 1 << 40
    n = int(rest // price.max_output_rate)
    # floating division may land one over; step down until it truly fits
    while n > 0 and worst_case_micros(price, prompt_tokens, n) > micros:
        n -= 1
    return n


def parse_price(value: object) -> Price:
    """A Price from config: a mapping with the field names, or an existing Price."""
    if isinstance(value, Price):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(PRICE_FIELDS)
        if unknown:
            raise ValueError(f"unknown price field(s): {', '.join(sorted(unknown))}")
        return Price(**{k: (None if v is None else float(v)) for k, v in value.items()})
    raise ValueError(f"a price must be a mapping of per-million-token rates, got {type(value).__name__}")
