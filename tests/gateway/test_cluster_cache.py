"""The cluster and the response cache on the gateway's request path, through the official `openai`
SDK: two stub replicas behind one model (retry before the first byte, prefix-aware placement) and the
exact + semantic cache (hits answered without the engine, settled with zero engine tokens)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway

from tokenops.bench.ports import free_port
from tokenops.bench.stub import StubConfig, run_stub_in_thread


@pytest.fixture
def replicas() -> Iterator[list[tuple[str, StubConfig]]]:
    out, stops = [], []
    for _ in range(2):
        cfg = StubConfig(models=[MODEL], output_tokens=8)
        url, stop = run_stub_in_thread(cfg)
        out.append((url, cfg))
        stops.append(stop)
    yield out
    for stop in stops:
        stop()


def two_replica_gateway(
    replicas: list[tuple[str, StubConfig]], tmp_path: Any, **extra: Any
) -> RunningGateway:
    settings = gateway_settings(replicas[0][0], tmp_path, **extra)
    settings.models[MODEL].backends = [url + "/v1" for url, _ in replicas]
    return start_gateway(settings)


@pytest.fixture
def gateway2(replicas: list[tuple[str, StubConfig]], tmp_path: Any) -> Iterator[RunningGateway]:
    gw = two_replica_gateway(replicas, tmp_path)
    yield gw
    gw.stop()


def stats(url: str) -> dict[str, int]:
    return httpx.get(url + "/stub/stats").json()


def served(replicas: list[tuple[str, StubConfig]]) -> list[int]:
    return [stats(url)["requests"] - stats(url)["failed"] for url, _ in replicas]


def test_a_failing_replica_is_retried_elsewhere_before_the_first_byte(
    gateway2: RunningGateway, replicas: list[tuple[str, StubConfig]]
) -> None:
    replicas[0][1].fail_status = 503  # every request to replica 0 fails before any byte of an answer
    client = gateway2.client(gateway2.new_key("failover"))
    for i in range(6):
        prompt = [{"role": "user", "content": f"question number {i}"}]
        if i % 2:
            chunks = list(client.chat.completions.create(model=MODEL, messages=prompt, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            assert client.chat.completions.create(model=MODEL, messages=prompt).choices[0].message.content
    assert stats(replicas[0][0])["failed"] >= 1  # replica 0 was tried...
    assert served(replicas) == [0, 6]  # ...and replica 1 answered everything
    rows = gateway2.wait_ledger(6)
    assert [r["status"] for r in rows] == ["ok"] * 6 and all(r["output_tokens"] == 8 for r in rows)


def test_requests_sharing_a_system_prompt_land_on_the_same_replica(
    gateway2: RunningGateway, replicas: list[tuple[str, StubConfig]]
) -> None:
    client = gateway2.client(gateway2.new_key("prefix"))
    for topic in ("billing", "shipping"):
        system = (
            f"You are the {topic} assistant of ACME Corp. Answer in one sentence, politely, citing policy. "
            * 4
        )
        before = served(replicas)
        for i in range(6):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{topic} question {i}?"},
            ]
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        delta = sorted(b - a for a, b in zip(before, served(replicas), strict=True))
        assert delta == [0, 6], f"{topic}: the shared prefix was split across replicas ({delta})"


def wait_stored(gw: RunningGateway, count: int, timeout: float = 60.0) -> None:
    """The gateway stores an answer after the client has it (and after the ledger row), so a test
    waits for the store before asking again; the first store also loads the embedder."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in httpx.get(gw.url + "/metrics").text.splitlines():
            if line.startswith("tokenops_cache_stores_total ") and float(line.split()[1]) >= count:
                return
        time.sleep(0.05)
    raise AssertionError(f"the cache did not store {count} answers within {timeout} s")


def ask(client: Any, text: str, **kw: Any) -> Any:
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}]
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, **kw
    )


def test_deterministic_requests_are_answered_from_the_cache(
    gateway2: RunningGateway, replicas: list[tuple[str, StubConfig]]
) -> None:
    gw = gateway2
    key = gw.new_key("cached")
    key_id = next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == "cached")
    client = gw.client(key, timeout=300)
    base = sum(served(replicas))

    first = ask(client, "How do I reset my password?")
    assert first.headers["x-tokenops-cache"] == "miss"
    wait_stored(gw, 1)
    second = ask(client, "How do I reset my password?")
    assert second.headers["x-tokenops-cache"] == "hit-exact"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert second.parse().id != first.parse().id
    assert sum(served(replicas)) == base + 1  # the engine saw the question once
    rows = gw.wait_ledger(2, key_id=key_id)
    assert rows[0]["status"] == "ok" and rows[0]["output_tokens"] == 8
    hit_row = rows[1]
    assert hit_row["status"] == "cache_hit" and hit_row["http_status"] == 200
    assert hit_row["uncached_input_tokens"] == hit_row["output_tokens"] == hit_row["cost_micros"] == 0

    # a streaming client gets the cached answer as SSE
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "How do I reset my password?"},
        ],
        temperature=0,
        stream=True,
    ) as streamed:
        assert streamed.headers["x-tokenops-cache"] == "hit-exact"
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    assert text == first.parse().choices[0].message.content

    paraphrase = ask(client, "How can I reset my password?")
    assert paraphrase.headers["x-tokenops-cache"] == "hit-semantic"
    hit_id = paraphrase.headers["x-tokenops-cache-id"]

    assert ask(client, "What is 12 times 7?").headers["x-tokenops-cache"] == "miss"
    assert ask(client, "What is 12 times 8?").headers["x-tokenops-cache"] == "miss"  # a number differs
    other = gw.client(gw.new_key("other-tenant", org="other-org"), timeout=300)
    assert ask(other, "How do I reset my password?").headers["x-tokenops-cache"] == "miss"  # another tenant
    assert sum(served(replicas)) == base + 4

    # an operator reports the paraphrase's hit as wrong: its entry is dropped, the next ask misses
    r = gw.admin("POST", "/admin/cache/false-hits", json={"hit_id": hit_id})
    assert r.status_code == 200, r.text
    assert gw.admin("POST", "/admin/cache/false-hits", json={"hit_id": hit_id}).status_code == 404
    assert ask(client, "How do I reset my password?").headers["x-tokenops-cache"] == "miss"
    assert sum(served(replicas)) == base + 5

    # Cache-Control: no-cache goes to the engine (and says nothing about the cache)
    fresh = ask(client, "How do I reset my password?", extra_headers={"Cache-Control": "no-cache"})
    assert "x-tokenops-cache" not in fresh.headers and sum(served(replicas)) == base + 6

    # sampled requests bypass the cache entirely
    sampled = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert "x-tokenops-cache" not in sampled.headers
    assert gw.admin("GET", "/admin/cluster").json()["models"][MODEL]["policy"] == "prefix_aware"


def test_virtual_model_is_planned_by_fusion(replicas: list[tuple[str, StubConfig]], tmp_path: Any) -> None:
    urls = [url + "/v1" for url, _ in replicas]
    models = {
        name: {"backends": urls, "pricing": {"input": 1.0, "output": 2.0}} for name in (MODEL, "stub-strong")
    }
    settings = gateway_settings(
        replicas[0][0],
        tmp_path,
        models=models,
        routes={"auto": {"cheap": MODEL, "strong": "stub-strong", "router": "rules"}},
    )
    gw = start_gateway(settings)
    try:
        client = gw.client(gw.new_key("routed"))
        assert "auto" in {m.id for m in client.models.list().data}
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "hi"}]
        )
        served = raw.headers["x-tokenops-model"]
        assert served in (MODEL, "stub-strong") and raw.parse().choices[0].message.content
        route = raw.headers["x-tokenops-route"]
        assert route.startswith("route=auto; model=" + served) and "reason=rules" in route
        row = gw.wait_ledger(1)[0]
        assert row["model_served"] == served and row["status"] == "ok"
        assert row["route"] == route and row["degraded"] is None  # the ledger says why this model served it
    finally:
        gw.stop()


def test_a_pool_that_is_down_falls_back_and_the_ledger_says_so(
    replicas: list[tuple[str, StubConfig]], tmp_path: Any
) -> None:
    models = {
        "big": {
            "backends": [f"http://127.0.0.1:{free_port()}/v1"],
            "pricing": {"input": 5.0, "output": 10.0},
        },
        MODEL: {"backends": [replicas[0][0] + "/v1"], "pricing": {"input": 1.0, "output": 2.0}},
    }
    cluster = {"models": {"big": {"fallback": [MODEL]}}, "retry": {"attempts": 1, "backoff_base_s": 0.0}}
    gw = start_gateway(gateway_settings(replicas[0][0], tmp_path, models=models, cluster=cluster))
    try:
        client = gw.client(gw.new_key("fallback"))
        raw = client.chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["x-tokenops-model"] == MODEL and raw.parse().choices[0].message.content
        reason = raw.headers["x-tokenops-degraded"]
        assert "fallback: big unavailable" in reason
        row = gw.wait_ledger(1)[0]
        assert row["model_requested"] == "big" and row["model_served"] == MODEL
        assert row["degraded"] == reason and row["route"] is None
        # billed at the price of the model that served it: 1 and 2 per million, not 5 and 10
        assert row["cost_micros"] == row["uncached_input_tokens"] * 1 + row["output_tokens"] * 2
    finally:
        gw.stop()
