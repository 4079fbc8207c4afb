"""Metric arithmetic on constructed timelines (no clock, no server)."""

from __future__ import annotations

import pytest

from tokenops.bench.metrics import SLO, Pricing, RequestRecord, max_concurrency_seen, summarize


def rec(start, chunks, end, out=None, prompt=10, cached=0, success=True):
    return RequestRecord(
        start=start,
        end=end,
        chunk_times=list(chunks),
        output_tokens=out,
        prompt_tokens=prompt,
        cached_tokens=cached,
        success=success,
    )


def test_single_request_definitions():
    r = rec(0.0, [0.1, 0.15, 0.25, 0.30], 0.31, out=4)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.31)
    assert r.itl == pytest.approx([0.05, 0.10, 0.05])
    assert r.tpot == pytest.approx((0.31 - 0.1) / 3)


def test_one_token_and_empty_stream():
    one = rec(0.0, [0.2], 0.25, out=1)
    assert one.ttft == pytest.approx(0.2) and one.tpot is None and one.itl == []
    empty = rec(0.0, [], 0.05, out=0)
    assert empty.ttft is None and empty.tpot is None and empty.itl == [] and empty.output_len == 0
    s = summarize([one, empty], 1.0, slo=SLO(ttft=0.5, tpot=0.001))
    assert s["completed"] == 2
    assert s["mean_ttft_ms"] == pytest.approx(200.0)  # the empty stream has no TTFT
    assert s["mean_tpot_ms"] == 0.0  # no request with >= 2 tokens
    assert s["total_output_tokens"] == 1
    # one-token answer counts as TPOT 0 (vLLM); the empty stream cannot show a TTFT
    assert s["good_requests"] == 1


def test_ttfb():
    r = RequestRecord(start=1.0, end=2.0, chunk_times=[1.5], first_byte=1.1, output_tokens=1)
    assert r.ttfb == pytest.approx(0.1)
    s = summarize([r, rec(0, [0.5], 1.0, out=1)], 1.0)
    assert s["median_ttfb_ms"] == pytest.approx(100.0)  # records without a first byte are left out


def test_output_len_falls_back_to_chunks_and_usage_wins():
    assert rec(0, [1, 2, 3], 4).output_len == 3
    # two chunks carrying 6 tokens: TPOT uses tokens, ITL uses chunk gaps
    r = rec(0, [1.0, 2.0], 2.0, out=6)
    assert r.tpot == pytest.approx(1.0 / 5)
    assert r.itl == [1.0]


def test_summary_percentiles_and_throughput():
    recs = [
        rec(float(i), [i + 0.1 * (i + 1), i + 0.1 * (i + 1) + 0.02], i + 1.0, out=2, prompt=100)
        for i in range(10)
    ]
    s = summarize(recs, 10.0)
    ttfts_ms = [100.0 * (i + 1) for i in range(10)]
    assert s["mean_ttft_ms"] == pytest.approx(sum(ttfts_ms) / 10)
    assert s["median_ttft_ms"] == pytest.approx(550.0)
    assert s["p99_ttft_ms"] == pytest.approx(991.0)  # numpy linear interpolation, as vLLM
    assert s["p90_ttft_ms"] == pytest.approx(910.0)
    assert s["mean_itl_ms"] == pytest.approx(20.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(102.0)
    assert s["rpm"] == pytest.approx(60.0) and s["tpm"] == pytest.approx(102 * 60)
    assert s["mean_e2el_ms"] == pytest.approx(1000.0)
    assert s["request_goodput"] is None
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "std_e2el_ms"):
        assert key in s


def test_goodput_counting():
    fast = rec(0, [0.1, 0.12, 0.14], 0.14, out=3)  # ttft 100ms, tpot 20ms
    slow_first = rec(0, [0.9, 0.92], 0.92, out=2)  # ttft 900ms
    slow_decode = rec(0, [0.1, 0.5], 0.5, out=2)  # tpot 400ms
    failed = rec(0, [], 0.01, out=0, success=False)
    recs = [fast, slow_first, slow_decode, failed]
    s = summarize(recs, 2.0, slo=SLO.parse("ttft=500ms,tpot=50ms"))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["good_requests"] == 1
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    s = summarize(recs, 2.0, slo=SLO.parse("e2e=1s"))
    assert s["good_requests"] == 3
    s = summarize(recs, 2.0, slo=SLO.parse("itl=100ms"))
    assert s["good_requests"] == 2  # slow_decode has a 400 ms stall


def test_slo_parse():
    assert SLO.parse("ttft=0.5s, tpot:40, e2el=3000ms") == SLO(ttft=0.5, tpot=0.04, e2e=3.0)
    assert SLO.parse("") is None
    with pytest.raises(ValueError, match="unknown SLO metric"):
        SLO.parse("foo=1ms")
    with pytest.raises(ValueError, match="bad SLO term"):
        SLO.parse("ttft=fast")


def test_cost_and_mfu():
    recs = [rec(0, [0.5, 1.0], 1.0, out=1_000, prompt=3_000, cached=1_000)]
    s = summarize(
        recs,
        10.0,
        pricing=Pricing(input_per_m=1.0, output_per_m=4.0, cached_input_per_m=0.1, hourly=3.6),
        params=1e9,
        peak_tflops=1.0,
    )
    # 2000 uncached * $1 + 1000 cached * $0.1 + 1000 out * $4, per million
    assert s["cost_usd"] == pytest.approx((2000 * 1.0 + 1000 * 0.1 + 1000 * 4.0) / 1e6)
    assert s["cost_per_million_tokens"] == pytest.approx(s["cost_usd"] / 4000 * 1e6)
    assert s["hardware_cost_usd"] == pytest.approx(0.01)
    assert s["hardware_cost_per_million_output_tokens"] == pytest.approx(10.0)
    assert s["cache_hit_rate"] == pytest.approx(1 / 3)
    assert s["mfu"] == pytest.approx(2e9 * 4000 / 10.0 / 1e12)


def test_max_concurrency_and_peak_throughput():
    recs = [rec(0, [0.5], 1.0, out=1), rec(0.5, [0.6], 2.0, out=1), rec(1.0, [1.5], 3.0, out=1)]
    assert max_concurrency_seen(recs) == 2  # a request ending at t and one starting at t do not overlap
    s = summarize(recs, 3.0)
    assert s["max_output_tokens_per_s"] == pytest.approx(2.0)
    assert summarize([], 1.0)["completed"] == 0
