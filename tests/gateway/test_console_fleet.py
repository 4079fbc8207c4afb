"""The console's budgets and fleet pages against live state: a reservation in flight while a slow
request runs, a replica's own load report (KV usage, prefix-cache hit rate) read by the poller, the
response cache's hits, and a route's shares by serving model from the ledger."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_harness import ADMIN_KEY, RunningGateway, gateway_settings, start_gateway
from reporting_replica import reporting_replica

from tokenops.bench.stub import StubConfig, run_stub_in_thread


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    fast_url, stop_fast = run_stub_in_thread(StubConfig(models=["cheap", "strong"], output_tokens=4))
    slow_url, stop_slow = run_stub_in_thread(StubConfig(models=["slow"], output_tokens=4, ttft_s=1.5))
    engine_url, stop_engine = reporting_replica()
    model = {"template_overhead_tokens": 16, "pricing": {"input": 1.0, "output": 2.0}}
    settings = gateway_settings(
        fast_url,
        tmp_path_factory.mktemp("console-fleet"),
        models={
            "cheap": {**model, "backends": [fast_url + "/v1"]},
            "strong": {**model, "backends": [fast_url + "/v1"]},
            "slow": {**model, "backends": [slow_url + "/v1"]},
            "engine": {**model, "backends": [engine_url + "/v1"]},
        },
        routes={"auto": {"cheap": "cheap", "strong": "strong", "strategy": "route", "router": "rules"}},
        cache={"enabled": True, "semantic": False},
        cluster={
            "load_poll_interval_s": 0.1,
            "models": {"engine": {"kinds": {engine_url + "/v1": "tokenops"}}},
        },
    )
    gateway = start_gateway(settings)
    yield gateway
    gateway.stop()
    stop_fast()
    stop_slow()
    stop_engine()


def session(gw: RunningGateway, http: httpx.Client) -> dict[str, str]:
    r = http.post(gw.url + "/console/login", data={"key": ADMIN_KEY})
    return {"cookie": r.headers["set-cookie"].split(";")[0]}


def cell(html: str, anchor: str, name: str) -> str:
    tail = html[html.index(anchor) :]
    return re.search(rf'data-field="{name}"[^>]*>([^<]*)<', tail).group(1).strip()


def test_a_request_in_flight_holds_a_reservation_on_the_budgets_page(gw: RunningGateway) -> None:
    key = gw.new_key("slow-key", {"budget_micros": 1_000_000}, org="f-org", project="f-proj")
    anchor = 'data-node="f-org/f-proj/slow-key"'
    with httpx.Client(timeout=30) as http:
        cookie = session(gw, http)
        call = threading.Thread(
            target=lambda: gw.client(key).chat.completions.create(
                model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        )
        call.start()
        deadline = time.monotonic() + 10
        while True:  # the request is admitted, then waits 1.5 s for its first token
            html = http.get(gw.url + "/console/budgets", headers=cookie).text
            if anchor in html and cell(html, anchor, "reservations") == "1" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert cell(html, anchor, "reservations") == "1"
        assert float(cell(html, anchor, "reserved")) > 0
        call.join()
        html = http.get(gw.url + "/console/budgets", headers=cookie).text
        assert cell(html, anchor, "reservations") == "0" and cell(html, anchor, "reserved") == "0"
        spent = sum(r["cost_micros"] for r in gw.ledger(node_path="f-org/f-proj/slow-key"))
        assert round(float(cell(html, anchor, "spent")) * 1e6) == spent > 0


def test_the_fleet_page_shows_replica_reports_cache_hits_and_route_shares(gw: RunningGateway) -> None:
    client = gw.client(gw.new_key("fleet-key", org="g-org", project="g-proj"))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    client.chat.completions.create(model="auto", messages=question)  # the rules router: cheap
    client.chat.completions.create(model="auto", messages=question, extra_headers={"x-tokenops-task": "math"})
    client.chat.completions.create(model="auto", messages=question, extra_headers={"x-tokenops-task": "math"})
    client.chat.completions.create(model="engine", messages=question)
    same = [{"role": "user", "content": "the same question twice"}]
    client.chat.completions.create(model="cheap", messages=same, temperature=0)
    for _ in range(50):  # the answer is stored just after its client has it: asked again until a hit
        again = client.chat.completions.with_raw_response.create(model="cheap", messages=same, temperature=0)
        if again.headers["x-tokenops-cache"] == "hit-exact":
            break
        time.sleep(0.05)
    assert again.headers["x-tokenops-cache"] == "hit-exact"
    gw.wait_ledger(6, tenant="g-org")
    with httpx.Client(timeout=30) as http:
        cookie = session(gw, http)
        deadline = time.monotonic() + 10
        while True:  # the poller reads the replica's report every 0.1 s
            html = http.get(gw.url + "/console/fleet", headers=cookie).text
            if cell(html, 'data-replica="engine#0"', "kv_usage") != "-" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert cell(html, 'data-replica="engine#0"', "kv_usage") == "25.0%"
    assert cell(html, 'data-replica="engine#0"', "prefix_hit_rate") == "75.0%"
    assert cell(html, 'data-replica="engine#0"', "breaker").lower().endswith("closed")
    assert cell(html, 'data-testid="cache"', "hits-exact") == "1"
    route = html[html.index('data-route="auto"') :]
    assert cell(route, 'data-model="cheap"', "requests") == "1"
    assert cell(route, 'data-model="strong"', "requests") == "2"
    assert cell(route, 'data-model="strong"', "share") == "66.7%"
