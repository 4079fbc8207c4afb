"""Graceful degradation: under overload, or when the tenant's budget is nearly spent, serve a lighter
model (`degrade_to`) or shed the lowest priority classes first.

`DegradePolicy.decide(DegradeInput) -> DegradeDecision` is a pure function of its input (the pool's
utilisation, the request's priority, the budget fraction the admission left), like the balancing
policies, so a simulator can run it too. The decision carries a reason string that the gateway puts
in the `x-tokenops-degraded` response header and the ledger row. This module does not measure load or
budgets; it reads them from the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

DEGRADE_HEADER = "x-tokenops-degraded"


@dataclass(frozen=True, slots=True)
class DegradeRule:
    """One model's degradation knobs.

    `shed_at` maps a priority class (0 = most important) to the pool utilisation at or above which
    requests of that class, and of every less important (higher-numbered) class, are refused; a class
    with no threshold of its own or above it is never shed.
    """

    degrade_to: str | None = None
    overload_at: float = 0.9  # pool utilisation at which requests go to `degrade_to`
    budget_below: float = 0.1  # fraction of budget left under which requests go to `degrade_to`
    shed_at: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.overload_at or not 0 <= self.budget_below <= 1:
            raise ValueError("overload_at must be > 0 and budget_below in [0, 1]")


@dataclass(frozen=True, slots=True)
class DegradeInput:
    model: str
    utilisation: float  # the model's pool utilisation, 0..1, inf when the pool is down
    priority: int = 0
    budget_left: float | None = None  # fraction of the tightest budget still unspent; None = unlimited


@dataclass(frozen=True, slots=True)
class DegradeDecision:
    action: Literal["serve", "degrade", "shed"]
    model: str
    reason: str | None = None
    cause: Literal["overload", "budget"] | None = None  # what triggered a degrade or shed


class DegradePolicy:
    """Per-model rules; a model without a rule is always served as asked."""

    def __init__(self, rules: dict[str, DegradeRule] | None = None) -> None:
        self.rules = dict(rules or {})

    def decide(self, inp: DegradeInput) -> DegradeDecision:
        rule = self.rules.get(inp.model)
        if rule is None:
            return DegradeDecision("serve", inp.model)
        # a class is shed at the lowest threshold among itself and the more important classes, so a
        # less important class is never served while a more important one is being shed
        thresholds = [t for p, t in rule.shed_at.items() if p <= inp.priority]
        shed_from = min(thresholds, default=math.inf)
        if thresholds and inp.utilisation >= shed_from:
            return DegradeDecision(
                "shed",
                inp.model,
                f"shed: priority {inp.priority} at pool utilisation {inp.utilisation:.2f} >= {shed_from:.2f}",
                "overload",
            )
        if rule.degrade_to:
            if inp.utilisation >= rule.overload_at:
                return DegradeDecision(
                    "degrade",
                    rule.degrade_to,
                    f"overload: {inp.model} at utilisation {inp.utilisation:.2f}, "
                    f"served by {rule.degrade_to}",
                    "overload",
                )
            if inp.budget_left is not None and inp.budget_left < rule.budget_below:
                return DegradeDecision(
                    "degrade",
                    rule.degrade_to,
                    f"budget: {inp.budget_left:.0%} left, served by {rule.degrade_to}",
                    "budget",
                )
        return DegradeDecision("serve", inp.model)
