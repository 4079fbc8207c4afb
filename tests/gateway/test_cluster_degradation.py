"""Degradation and shedding through the gateway, and the cluster's Prometheus metrics, with the official
`openai` SDK against stub replicas: a key whose budget is nearly spent is served by the model's
`degrade_to` (header and ledger row say why), the lowest priority class is shed first under overload,
and the cluster's counters and gauges on /metrics move with the traffic."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import RunningGateway, gateway_settings, start_gateway
from prometheus_client.parser import text_string_to_metric_families

from tokenops.bench.stub import StubConfig, run_stub_in_thread

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def stubs() -> Iterator[dict[str, tuple[str, StubConfig]]]:
    out, stops = {}, []
    for name in ("big", "light"):
        cfg = StubConfig(models=[name], output_tokens=8)
        url, stop = run_stub_in_thread(cfg)
        out[name] = (url, cfg)
        stops.append(stop)
    yield out
    for stop in stops:
        stop()


def requests_served(url: str) -> int:
    s = httpx.get(url + "/stub/stats").json()
    return s["requests"] - s["failed"]


def samples(gw: RunningGateway, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric on the gateway's /metrics, keyed by its sorted labels."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_a_nearly_spent_budget_is_served_by_the_lighter_model(
    stubs: dict[str, tuple[str, StubConfig]], tmp_path: Any
) -> None:
    # output tokens dear enough that one answer spends most of the budget set below
    models = {
        "big": {"backends": [stubs["big"][0] + "/v1"], "pricing": {"input": 1.0, "output": 1000.0}},
        "light": {"backends": [stubs["light"][0] + "/v1"], "pricing": {"input": 1.0, "output": 100.0}},
    }
    cluster = {"models": {"big": {"degrade_to": "light", "budget_below": 0.1}}}
    gw = start_gateway(gateway_settings(stubs["big"][0], tmp_path, models=models, cluster=cluster))
    try:
        key = gw.new_key("thrifty", {"budget_micros": 10**9, "budget_period": "total"})
        client = gw.client(key)
        first = client.chat.completions.with_raw_response.create(model="big", messages=HI, max_tokens=64)
        assert first.headers["x-tokenops-model"] == "big" and "x-tokenops-degraded" not in first.headers
        spent = gw.wait_ledger(1)[0]["cost_micros"]
        assert spent >= 64_000

        # leave about 7% of the budget: enough for a short answer, below `budget_below`
        r = gw.admin(
            "PATCH", "/admin/tenants/org/proj/thrifty", json={"limits": {"budget_micros": spent + 5000}}
        )
        assert r.status_code == 200, r.text
        light_before = requests_served(stubs["light"][0])
        raw = client.chat.completions.with_raw_response.create(model="big", messages=HI, max_tokens=1)
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-tokenops-model"] == "light"
        reason = raw.headers["x-tokenops-degraded"]
        assert reason.startswith("budget: ") and reason.endswith("left, served by light"), reason
        assert requests_served(stubs["light"][0]) == light_before + 1

        # streamed too: the header comes with the stream
        with client.chat.completions.with_streaming_response.create(
            model="big", messages=HI, max_tokens=1, stream=True
        ) as streamed:
            assert streamed.headers["x-tokenops-model"] == "light"
            assert streamed.headers["x-tokenops-degraded"].startswith("budget: ")
            assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)

        rows = gw.wait_ledger(3)
        assert [r["model_served"] for r in rows] == ["big", "light", "light"]
        assert rows[0]["degraded"] is None and rows[1]["degraded"] == reason
        assert all(r["model_requested"] == "big" for r in rows)
        # billed at the light model's output price (100 per token), not big's (1000)
        assert rows[1]["cost_micros"] == rows[1]["uncached_input_tokens"] + 100 * rows[1]["output_tokens"]
        degraded = samples(gw, "tokenops_cluster_degradations_total")
        assert degraded == {(("cause", "budget"), ("model", "big"), ("served", "light")): 2.0}

        # a key without a budget is never degraded
        free = gw.client(gw.new_key("unmetered"))
        plain = free.chat.completions.with_raw_response.create(model="big", messages=HI, max_tokens=1)
        assert plain.headers["x-tokenops-model"] == "big" and "x-tokenops-degraded" not in plain.headers
    finally:
        gw.stop()


def test_overload_sheds_the_lowest_priority_class_first(
    stubs: dict[str, tuple[str, StubConfig]], tmp_path: Any
) -> None:
    url, cfg = stubs["big"]
    models = {"big": {"backends": [url + "/v1"], "max_inflight": 2}}
    # one request in flight of two slots is utilisation 0.5: class 2 is shed there, class 1 at 0.9
    cluster = {"models": {"big": {"shed_at": {2: 0.5, 1: 0.9}}}}
    gw = start_gateway(gateway_settings(url, tmp_path, models=models, cluster=cluster))
    keys = {p: gw.new_key(f"class{p}", {"priority": p}) for p in (0, 1, 2)}
    cfg.itl_s = 0.25  # 8 tokens: a request holds its slot for about 2 s

    async def ask(priority: int) -> str:
        async with gw.async_client(keys[priority]) as client:
            try:
                await client.chat.completions.create(model="big", messages=HI)
                return "ok"
            except openai.APIStatusError as e:
                assert e.status_code == 503 and e.response.headers.get("retry-after")
                assert "priority 2" in e.message and "higher-priority key" in e.message
                return e.code or str(e.status_code)

    async def scenario() -> list[str]:
        idle = await ask(2)  # an idle pool serves every class
        holder = asyncio.ensure_future(ask(0))
        async with httpx.AsyncClient() as http:  # wait until it holds one of the two slots
            while "tokenops_cluster_in_flight{" not in (
                text := (await http.get(gw.url + "/metrics")).text
            ) or ('tokenops_cluster_in_flight{model="big",replica="big#0"} 1.0' not in text):
                await asyncio.sleep(0.02)
        low, mid = await asyncio.gather(ask(2), ask(1))
        return [idle, low, mid, await holder]

    try:
        assert asyncio.run(scenario()) == ["ok", "overloaded", "ok", "ok"]
        rows = gw.wait_ledger(4)
        shed = [r for r in rows if r["http_status"] == 503]
        assert len(shed) == 1 and shed[0]["error_code"] == "overloaded" and shed[0]["cost_micros"] == 0
        assert samples(gw, "tokenops_cluster_sheds_total") == {(("model", "big"), ("priority", "2")): 1.0}
    finally:
        cfg.itl_s = 0.0
        gw.stop()


def test_cluster_metrics_move_with_traffic(stubs: dict[str, tuple[str, StubConfig]], tmp_path: Any) -> None:
    (url_a, cfg_a), (url_b, _) = stubs["big"], stubs["light"]
    models = {"m": {"backends": [url_a + "/v1", url_b + "/v1"], "max_inflight": 4}}
    cluster = {"breaker": {"failure_threshold": 1, "open_s": 60}, "retry": {"backoff_base_s": 0.0}}
    gw = start_gateway(gateway_settings(url_a, tmp_path, models=models, cluster=cluster))
    try:
        client = gw.client(gw.new_key("metrics"))
        system = "You are the support assistant of ACME. Answer briefly and cite the policy number. " * 3
        for i in range(4):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}]
            client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        picks = samples(gw, "tokenops_cluster_picks_total")
        assert sum(picks.values()) == 4
        reasons = {dict(k)["reason"] for k in picks}
        assert "prefix-hit" in reasons and reasons <= {"prefix-hit", "prefix-miss least-loaded"}
        assert {dict(k)["policy"] for k in picks} == {"prefix_aware"}
        assert samples(gw, "tokenops_cluster_in_flight") == {
            (("model", "m"), ("replica", "m#0")): 0.0,
            (("model", "m"), ("replica", "m#1")): 0.0,
        }
        assert set(samples(gw, "tokenops_cluster_breaker_state").values()) == {0.0}
        assert set(samples(gw, "tokenops_cluster_concurrency_limit").values()) == {4.0}
        assert samples(gw, "tokenops_cluster_retries_total") == {}

        # replica a fails before the first byte: the request is retried on b, a's breaker opens
        cfg_a.fail_status = 503
        sent = 0
        while httpx.get(url_a + "/stub/stats").json()["failed"] == 0:
            assert sent < 20, "no request was placed on replica a"
            # distinct first blocks (64 characters) spread over the pool
            text = f"Question {sent}: unrelated to the support prompt, long enough to fill a whole block."
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], max_tokens=2
            )
            sent += 1
        for i in range(2):  # a is out now: these go to b at once
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"more {i}"}], max_tokens=2
            )
        assert samples(gw, "tokenops_cluster_retries_total") == {(("model", "m"), ("replica", "m#0")): 1.0}
        breaker = samples(gw, "tokenops_cluster_breaker_state")
        assert (
            breaker[(("model", "m"), ("replica", "m#0"))] == 2.0
            and breaker[(("model", "m"), ("replica", "m#1"))] == 0.0
        )
        assert (
            sum(samples(gw, "tokenops_cluster_picks_total").values()) == 4 + sent + 2 + 1
        )  # the retry is a pick too
        # providers (kind openai) are not polled, so they have no load-report age
        assert samples(gw, "tokenops_cluster_load_report_age_seconds") == {}
        util = samples(gw, "tokenops_cluster_utilisation")[(("model", "m"),)]
        assert 0.0 <= util <= 1.0 and not math.isnan(util)
    finally:
        cfg_a.fail_status = None
        gw.stop()
