"""Reasoning effort as a routing decision: the level follows the router's score, never exceeds the
tenant's cap, is spelled as reasoning_effort or a thinking budget, and shows in the plan's header."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenops.fusion.effort import EffortPolicy
from tokenops.fusion.plan import FusionPlanner, RouteConfig
from tokenops.fusion.routers import Rule, RuleRouter


def test_level_follows_the_score_within_the_tenants_cap() -> None:
    policy = EffortPolicy(low_at=0.3, high_at=0.7, tenant_caps={"free": "low", "none": "off"})
    assert [policy.decide(s, "paid").level for s in (0.1, 0.3, 0.69, 0.7, 1.0)] == [
        "off", "low", "low", "high", "high",
    ]  # fmt: skip
    capped = policy.decide(0.9, "free")
    assert (capped.level, capped.capped, capped.fields) == ("low", True, {"reasoning_effort": "low"})
    assert capped.header() == "reasoning=low (capped)"
    assert policy.decide(0.9, "none").fields == {"reasoning_effort": "none"}
    assert policy.decide(0.1, "free").capped is False  # below the cap: nothing was lowered


def test_a_clients_own_effort_is_kept_but_capped() -> None:
    policy = EffortPolicy(tenant_caps={"free": "low"})
    assert policy.decide(0.0, "paid", "high").level == "high"  # the client asked: the score is not used
    d = policy.decide(0.0, "free", "high")
    assert (d.level, d.capped) == ("low", True)
    assert policy.decide(0.9, "paid", "bogus").level == "high"  # unknown values: the score decides


def test_budget_spelling_and_validation() -> None:
    policy = EffortPolicy(spelling="budget", low_budget=256, high_budget=4096, default_cap="low")
    assert policy.decide(0.95, None).fields == {"max_reasoning_tokens": 256}
    assert policy.decide(0.0, None).fields == {"max_reasoning_tokens": 0}
    with pytest.raises(ValueError, match="low_at <= high_at"):
        EffortPolicy(low_at=0.8, high_at=0.2)
    with pytest.raises(ValueError, match="must be one of off, low, high"):
        EffortPolicy(tenant_caps={"t": "max"})  # type: ignore[dict-item]


def test_the_planner_puts_the_decision_in_the_plan_and_its_header() -> None:
    router = RuleRouter([Rule(0.9, tasks=frozenset({"math"}))], default=0.1)
    route = RouteConfig(
        "think",
        "small",
        "big",
        router,
        target_strong_share=0.5,
        effort=EffortPolicy(tenant_caps={"free": "low"}),
    )
    planner = FusionPlanner({"think": route})
    body = {"messages": [{"role": "user", "content": "prove it"}], "metadata": {"task": "math"}}
    request = SimpleNamespace(kind="chat", body=body, model="think")
    paid = planner.plan(request, SimpleNamespace(principal=SimpleNamespace(tenant="paid")))
    assert paid.body_fields == {"reasoning_effort": "high"} and paid.header().endswith("; reasoning=high")
    free = planner.plan(request, SimpleNamespace(principal=SimpleNamespace(tenant="free")))
    assert free.body_fields == {"reasoning_effort": "low"} and "reasoning=low (capped)" in free.header()
    easy = SimpleNamespace(kind="chat", body={"messages": [{"role": "user", "content": "hi"}]}, model="think")
    assert planner.plan(easy).body_fields == {"reasoning_effort": "none"}
