"""Ops-aware routing through the running gateway: a route whose router would always answer strong
sends a tenant that has used its budget past the rule, or a low-class key, to the cheap model; the
ledger row's route column says why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_harness import RunningGateway, gateway_settings, start_gateway

from tokenops.bench.stub import StubConfig, run_stub_in_thread

PRICES = {"cheap": (1, 2), "strong": (10, 20)}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    stubs = {name: run_stub_in_thread(StubConfig(models=[name], output_tokens=8)) for name in PRICES}
    settings = gateway_settings(
        "unused",
        tmp_path_factory.mktemp("opsroute"),
        models={
            name: {
                "backends": [stubs[name][0] + "/v1"],
                "template_overhead_tokens": 16,
                "pricing": {"input": p_in, "output": p_out},
            }
            for name, (p_in, p_out) in PRICES.items()
        },
        routes={
            "auto": {
                "cheap": "cheap",
                "strong": "strong",
                "target_strong_share": 1.0,
                "ops": {"budget_used_at_least": 0.15, "priority_at_least": 2},
            }
        },
    )
    g = start_gateway(settings)
    yield g
    g.stop()
    for _, stop in stubs.values():
        stop()


def _key_id(gw: RunningGateway, name: str) -> str:
    return next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == name)


def _ask(gw: RunningGateway, key: str) -> str:
    with gw.client(key) as client:
        r = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "hello there"}], max_tokens=8
        )
        return r.headers["x-tokenops-route"]


def test_a_tenant_near_its_budget_is_routed_cheap(gw: RunningGateway) -> None:
    limits = {"budget_micros": 1000, "budget_period": "day", "alert_thresholds": [0.1]}
    key = gw.new_key("budgeted", limits, org="near-budget")
    first = _ask(gw, key)
    assert "model=strong" in first
    rows = gw.wait_ledger(1, key_id=_key_id(gw, "budgeted"))
    assert rows[0]["model_served"] == "strong" and rows[0]["cost_micros"] / 1000 >= 0.15
    second = _ask(gw, key)
    assert "model=cheap" in second and "reason=ops budget" in second
    rows = gw.wait_ledger(2, key_id=_key_id(gw, "budgeted"))
    assert rows[1]["model_served"] == "cheap"
    assert "reason=ops budget" in rows[1]["route"] and "used >= 15%" in rows[1]["route"]
    # the key's node crossed its 10% alert on the first request, once
    fired = gw.admin("GET", "/admin/alerts").json()["data"]
    assert [(a["node_path"], a["threshold"]) for a in fired] == [("near-budget/proj/budgeted", 0.1)]


def test_a_low_class_key_is_routed_cheap(gw: RunningGateway) -> None:
    high = gw.new_key("class-1", {"priority": 1}, org="classes")
    low = gw.new_key("class-2", {"priority": 2}, org="classes")
    assert "model=strong" in _ask(gw, high)
    assert "reason=ops priority class 2 >= 2" in _ask(gw, low)
    row = gw.wait_ledger(1, key_id=_key_id(gw, "class-2"))[0]
    assert row["model_served"] == "cheap" and "ops priority class 2" in row["route"]
