"""The token types a request is metered in, defined once: every list of types derives from `TOKEN_TYPES`.

A type has the name it carries in `TokenUsage`, ledger rows, usage reports and metrics labels; the
ledger column that holds it (fixed by the migrations); the price field that bills it (per million
tokens) and the field whose rate it takes when its own is unset; whether it is a share of the prompt
or of the completion; and whether it counts towards a request's total tokens. This module owns the
definition only: pricing's arithmetic is `ops.pricing`'s, the columns' table `ops.models`'.
It imports nothing of tokenops, so config, ops, gateway and bench all read it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class TokenType:
    name: str
    column: str  # the ledger column (the migrations fix these names)
    price_field: str  # the price per million tokens that bills it
    part: Literal["prompt", "completion"]
    # incremental prefill is a meter over the prompt (tokens the engines computed, else new input since
    # the session's previous turn), not an extra share of it: it is billed only as a surcharge and
    # never adds to a total
    counted: bool = True
    price_fallback: str | None = None  # the field whose rate applies while this type's is unset


UNCACHED_INPUT = TokenType("uncached_input", "uncached_input_tokens", "input", "prompt")
CACHED_INPUT = TokenType(
    "cached_input", "cached_input_tokens", "cached_input", "prompt", price_fallback="input"
)
INCREMENTAL_PREFILL = TokenType(
    "incremental_prefill", "incremental_prefill_tokens", "incremental_prefill", "prompt", counted=False
)
OUTPUT = TokenType("output", "output_tokens", "output", "completion")
REASONING = TokenType("reasoning", "reasoning_tokens", "reasoning", "completion", price_fallback="output")

# the order of the ledger's columns, of TokenUsage's fields and of the usage report's
TOKEN_TYPES: tuple[TokenType, ...] = (UNCACHED_INPUT, CACHED_INPUT, INCREMENTAL_PREFILL, OUTPUT, REASONING)
TOKEN_TYPE_NAMES: tuple[str, ...] = tuple(t.name for t in TOKEN_TYPES)
# the types whose sum is a request's tokens (prompt + completion)
COUNTED_TYPES: tuple[TokenType, ...] = tuple(t for t in TOKEN_TYPES if t.counted)
PRICE_FIELDS: tuple[str, ...] = tuple(t.price_field for t in TOKEN_TYPES)

__all__ = [
    "TokenType",
    "UNCACHED_INPUT",
    "CACHED_INPUT",
    "INCREMENTAL_PREFILL",
    "OUTPUT",
    "REASONING",
    "TOKEN_TYPES",
    "TOKEN_TYPE_NAMES",
    "COUNTED_TYPES",
    "PRICE_FIELDS",
]
