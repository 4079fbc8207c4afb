"""The ops rule of a route: near the budget or in a low class, the planner sends the cheap model
whatever the router scored, and names why in the plan (the header and the ledger's route column)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenops.fusion.ops_rule import OpsRule
from tokenops.fusion.plan import FusionPlanner, RouteConfig
from tokenops.fusion.routers import make_router


@dataclass
class _Request:
    model: str
    kind: str = "chat"
    body: dict | None = None

    def __post_init__(self) -> None:
        self.body = self.body or {"messages": [{"role": "user", "content": "prove the theorem"}]}


@dataclass
class _Admission:
    budget_left: float | None
    priority: int


def planner(strategy: str = "single") -> FusionPlanner:
    route = RouteConfig(
        "auto",
        "cheap",
        "strong",
        make_router("rules"),
        target_strong_share=1.0,  # the router alone would always answer strong
        strategy=strategy,  # type: ignore[arg-type]
        ops=OpsRule(budget_used_at_least=0.8, priority_at_least=2),
    )
    return FusionPlanner({"auto": route})


def test_the_rule_names_its_reason() -> None:
    rule = OpsRule(budget_used_at_least=0.8, priority_at_least=2)
    assert rule.cheap_because(0.5, 1) is None
    assert rule.cheap_because(None, 1) is None  # no budget on the path: nothing is near it
    assert rule.cheap_because(0.15, 1) == "ops budget 85% used >= 80%"
    assert rule.cheap_because(0.9, 3) == "ops priority class 3 >= 2"
    assert OpsRule().cheap_because(0.0, 9) is None


def test_near_the_budget_or_low_class_plans_cheap() -> None:
    fp = planner()
    assert fp.plan(_Request("auto"), _Admission(0.9, 1)).model == "strong"
    near = fp.plan(_Request("auto"), _Admission(0.1, 1))
    assert near.model == "cheap"
    assert near.header() == "route=auto; model=cheap; reason=ops budget 90% used >= 80%"
    low = fp.plan(_Request("auto"), _Admission(1.0, 2))
    assert low.model == "cheap" and "ops priority class 2" in low.reason


def test_a_cascade_starts_at_its_cheap_tier() -> None:
    fp = planner("cascade")
    assert fp.plan(_Request("auto"), _Admission(1.0, 1)).models == ("strong",)  # the router: strong first
    cut = fp.plan(_Request("auto"), _Admission(0.05, 1))
    assert cut.models == ("cheap", "strong") and cut.strategy == "cascade"
    assert cut.reason.startswith("ops budget 95% used")
