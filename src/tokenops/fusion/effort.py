"""Reasoning effort as a routing decision: whether a reasoning-capable model thinks, and how much.

This module owns `EffortPolicy` (the score thresholds of off / low / high, how a level is spelled
to the backend: OpenAI's `reasoning_effort` or a thinking-token budget, `max_reasoning_tokens`, and
the cap per tenant) and `EffortDecision` (the level chosen for one request and the body fields
that carry it). The level follows the router's score, the same predicted difficulty that picks the
model, and never exceeds the tenant's cap; a client that asks for an effort itself gets it, lowered
to the cap. It does not score requests (routers.py) or send them (executor.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Level = Literal["off", "low", "high"]
LEVELS: tuple[Level, ...] = ("off", "low", "high")
# how a client's own reasoning_effort maps onto the three levels
_CLIENT_EFFORT: dict[str, Level] = {
    "none": "off",
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
}


@dataclass(frozen=True, slots=True)
class EffortDecision:
    level: Level
    score: float
    capped: bool  # the tenant's cap lowered the level the score (or the client) asked for
    fields: dict[str, Any]  # what the upstream body gets

    def header(self) -> str:
        """The part of `x-tokenops-route` (and the ledger's `route`) that says what was decided."""
        return f"reasoning={self.level}" + (" (capped)" if self.capped else "")


@dataclass(frozen=True, slots=True)
class EffortPolicy:
    """Scores below `low_at` think not at all, below `high_at` a little, the rest a lot.

    `spelling`: "effort" sends `reasoning_effort` (none / low / high: OpenAI, vLLM, `tokenops
    engine`); "budget" sends `max_reasoning_tokens` (0 / `low_budget` / `high_budget`: a thinking
    budget the `tokenops engine` enforces). `default_cap` bounds every tenant not in `tenant_caps`."""

    low_at: float = 0.3
    high_at: float = 0.7
    spelling: Literal["effort", "budget"] = "effort"
    low_budget: int = 1024
    high_budget: int = 8192
    default_cap: Level = "high"
    tenant_caps: Mapping[str, Level] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_at <= self.high_at <= 1.0:
            raise ValueError(f"need 0 <= low_at <= high_at <= 1, got {self.low_at} and {self.high_at}")
        if not 0 < self.low_budget <= self.high_budget:
            raise ValueError("need 0 < low_budget <= high_budget")
        for who, cap in {"default_cap": self.default_cap, **self.tenant_caps}.items():
            if cap not in LEVELS:
                raise ValueError(f"reasoning cap of {who!r} must be one of {', '.join(LEVELS)}, got {cap!r}")

    def cap(self, tenant: str | None) -> Level:
        return self.tenant_caps.get(tenant or "", self.default_cap)

    def decide(self, score: float, tenant: str | None, client_effort: Any = None) -> EffortDecision:
        """The level for a request the router scored `score`, within `tenant`'s cap. A client's own
        `reasoning_effort` (a known value) replaces the score's choice, still within the cap."""
        if isinstance(client_effort, str) and client_effort in _CLIENT_EFFORT:
            wanted = _CLIENT_EFFORT[client_effort]
        else:
            wanted = "off" if score < self.low_at else "low" if score < self.high_at else "high"
        cap = self.cap(tenant)
        level = min(wanted, cap, key=LEVELS.index)
        return EffortDecision(level, score, level != wanted, self.fields(level))

    def fields(self, level: Level) -> dict[str, Any]:
        if self.spelling == "effort":
            return {"reasoning_effort": {"off": "none", "low": "low", "high": "high"}[level]}
        budget = {"off": 0, "low": self.low_budget, "high": self.high_budget}[level]
        return {"max_reasoning_tokens": budget}
