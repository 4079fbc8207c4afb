"""The gateway's own time on a request (`tokenops_gateway_*_seconds` on /metrics), through a real
gateway in front of the bench stub: one observation per dispatched request in each histogram, every
interval non-negative and inside the request's end-to-end time as the client saw it. No speed is
asserted."""

from __future__ import annotations

import time

import httpx
from gateway_harness import MODEL, RunningGateway
from prometheus_client.parser import text_string_to_metric_families

MSG = [{"role": "user", "content": "say something"}]
PATH = ("pre_upstream", "first_byte", "last_byte", "added")


def histograms(gw: RunningGateway) -> dict[str, tuple[float, float]]:
    """(count, sum) of each tokenops_gateway_* histogram for the stub's model."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text):
        if not family.name.startswith("tokenops_gateway_"):
            continue
        samples = {s.name: s.value for s in family.samples if s.labels.get("model") == MODEL}
        name = family.name.removeprefix("tokenops_gateway_").removesuffix("_seconds")
        out[name] = (samples.get(family.name + "_count", 0.0), samples.get(family.name + "_sum", 0.0))
    return out


def observed(gw: RunningGateway, before: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(count, sum) added since `before`, once the request's settle has been observed (after its last
    byte)."""
    deadline = time.monotonic() + 10
    while True:
        now = histograms(gw)
        if now["settle"][0] > before.get("settle", (0, 0))[0] or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return {k: (c - before.get(k, (0, 0))[0], s - before.get(k, (0, 0))[1]) for k, (c, s) in now.items()}


def test_a_stream_is_timed_once_per_request(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("timed-stream"))
    for _ in range(3):
        before = histograms(gateway)
        t0 = time.perf_counter()
        chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, stream=True))
        e2e = time.perf_counter() - t0
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
        d = observed(gateway, before)
        for name in (*PATH, "relay_read", "settle"):
            count, total = d[name]
            assert count == 1, (name, d)
            # the settle runs after the client's last byte: it may outlast the client's e2e
            assert 0 <= total <= (float("inf") if name == "settle" else e2e), (name, total, e2e)
        assert abs(d["added"][1] - d["pre_upstream"][1] - d["last_byte"][1]) < 1e-6


def test_a_whole_answer_is_timed_once_per_request(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("timed-whole"))
    for prompt in ("one two", "three four"):
        before = histograms(gateway)
        t0 = time.perf_counter()
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        e2e = time.perf_counter() - t0
        assert out.usage.completion_tokens == 3
        d = observed(gateway, before)
        for name in (*PATH, "settle"):
            count, total = d[name]
            assert count == 1, (name, d)
            assert 0 <= total <= (float("inf") if name == "settle" else e2e), (name, total, e2e)
        assert d["relay_read"][0] == 0  # per-read relay is for streams only


def test_a_cache_hit_settles_without_an_upstream_path(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("timed-cache"))
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "cache me"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    client.chat.completions.create(**ask)
    before = histograms(gateway)
    raw = client.chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-tokenops-cache"].startswith("hit")
    d = observed(gateway, before)
    assert d["settle"][0] == 1
    assert all(d[name][0] == 0 for name in PATH)
