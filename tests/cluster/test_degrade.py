"""The degradation policy as a pure function: shed the least important classes first, degrade to a
lighter model under overload or a nearly spent budget, and say why."""

from __future__ import annotations

import math

from tokenops.cluster.degrade import DegradeInput, DegradePolicy, DegradeRule

POLICY = DegradePolicy(
    {"big": DegradeRule(degrade_to="light", overload_at=0.8, budget_below=0.1, shed_at={2: 0.9, 1: 0.97})}
)


def decide(util: float, priority: int = 0, budget: float | None = None, model: str = "big"):  # noqa: ANN201
    return POLICY.decide(DegradeInput(model, util, priority, budget))


def test_serves_as_asked_when_calm_and_for_models_without_rules() -> None:
    assert decide(0.5).action == "serve" and decide(0.5).reason is None
    assert decide(5.0, model="other").action == "serve"


def test_least_important_class_is_shed_first() -> None:
    assert [decide(0.92, p).action for p in (0, 1, 2)] == ["degrade", "degrade", "shed"]
    assert [decide(0.98, p).action for p in (0, 1, 2)] == ["degrade", "shed", "shed"]
    assert decide(math.inf, 0).action == "degrade"  # class 0 has no threshold: never shed
    assert "priority 2" in (decide(0.95, 2).reason or "")


def test_a_misordered_config_still_never_sheds_a_more_important_class_first() -> None:
    p = DegradePolicy({"m": DegradeRule(shed_at={2: 0.99, 1: 0.9})})
    assert p.decide(DegradeInput("m", 0.95, 2)).action == "shed"  # inherits class 1's lower threshold
    assert p.decide(DegradeInput("m", 0.95, 1)).action == "shed"
    assert p.decide(DegradeInput("m", 0.95, 0)).action == "serve"


def test_degrades_on_overload_or_budget_with_a_reason() -> None:
    d = decide(0.85)
    assert (d.action, d.model) == ("degrade", "light") and d.reason.startswith("overload")
    d = decide(0.2, budget=0.05)
    assert (d.action, d.model, d.reason) == ("degrade", "light", "budget: 5% left, served by light")
    assert decide(0.2, budget=0.5).action == "serve"
