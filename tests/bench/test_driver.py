"""End-to-end runs of the load driver against the stub upstream, whose pace is known.

Only lower bounds on time are asserted (the stub sleeps at least its delays); never upper bounds.
"""

from __future__ import annotations

import itertools
import math

import httpx
import pytest

from tokenops.bench.driver import LoadConfig, run_load
from tokenops.bench.metrics import SLO, summarize
from tokenops.bench.stub import StubConfig, run_stub_in_thread
from tokenops.bench.traces import TraceRecord, write_trace
from tokenops.bench.workloads import make_workload

TTFT, ITL = 0.03, 0.01
# the stub's loop (libuv) keeps timers in whole milliseconds and may fire one up to ~1 ms before the
# float deadline: lower bounds on measured delays allow that much, no more
SLACK = 0.002


@pytest.fixture(scope="module")
def stub():
    cfg = StubConfig(ttft_s=TTFT, itl_s=ITL, block_size=16)
    url, stop = run_stub_in_thread(cfg)
    yield url, cfg
    stop()


def test_fixed_concurrency_timings_and_exact_counts(stub):
    url, _ = stub
    wl = make_workload("random", seed=1, input_len="uniform:20,60", output_len="uniform:2,6", block_size=16)
    expected = list(
        itertools.islice(
            make_workload(
                "random", seed=1, input_len="uniform:20,60", output_len="uniform:2,6", block_size=16
            ),
            8,
        )
    )
    res = run_load(LoadConfig(url, concurrency=4, num_requests=8), wl)
    assert len(res.records) == 8 and all(r.success for r in res.records)
    got = sorted((r.prompt_tokens, r.output_tokens) for r in res.records)
    assert got == sorted((s[0].input_length, s[0].output_length) for s in expected)
    for r in res.records:
        assert r.ttft >= TTFT - SLACK
        assert r.ttfb is not None and r.ttfb <= r.ttft  # the role chunk comes before the first token
        assert len(r.chunk_times) == r.output_tokens
        # a late read can merge chunks (so one gap may look short), but the last token cannot arrive
        # before the server's first-token delay plus every inter-token delay has passed
        assert r.chunk_times[-1] - r.start >= TTFT + (r.output_tokens - 1) * ITL - SLACK
        assert len(r.itl) == r.output_tokens - 1
    s = summarize(res.records, res.duration_s, slo=SLO(ttft=60.0))
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["mean_ttft_ms"] >= (TTFT - SLACK) * 1000
    # pooled over a run, the gaps sum to at least the server's pacing of every answer
    assert sum(sum(r.itl) + r.ttft for r in res.records) >= sum(
        TTFT + (r.output_tokens - 1) * ITL - SLACK for r in res.records
    )
    assert s["max_concurrent_requests"] <= 4
    assert s["good_requests"] == 8
    assert res.config["mode"] == "concurrency"


def test_multi_turn_sessions_are_ordered_with_real_answers(stub):
    url, _ = stub
    before = httpx.get(url + "/stub/stats").json()["with_session"]
    wl = make_workload(
        "multi-turn", seed=5, turns="3", input_len="12", output_len="4", think_s="0.02", block_size=16
    )
    res = run_load(LoadConfig(url, concurrency=2, num_requests=9), wl)
    assert len(res.records) == 9 and all(r.success for r in res.records)
    by_session = {}
    for r in res.records:
        by_session.setdefault(r.session_id, []).append(r)
    for recs in by_session.values():
        recs.sort(key=lambda r: r.round)
        assert [r.round for r in recs] == list(range(len(recs)))
        for a, b in itertools.pairwise(recs):
            assert b.start >= a.end + 0.02  # round k+1 only after round k finished, plus think time
            # the stub counts prompt words: the previous prompt, the real answer, the new message
            assert b.prompt_tokens == a.prompt_tokens + a.output_tokens + 12
    # every round of a session carries its id for session-aware balancing
    assert httpx.get(url + "/stub/stats").json()["with_session"] - before == 9


def test_open_loop_rate_with_warmup_and_failures(stub):
    url, cfg = stub
    before = cfg.__dict__.copy()
    cfg.fail_status, cfg.fail_count = 500, 2
    try:
        res = run_load(
            LoadConfig(url, rate=200.0, burstiness=0.5, num_requests=10, warmup=2, seed=3),
            make_workload("random", seed=2, input_len="10", output_len="3", block_size=16),
        )
    finally:
        cfg.fail_status, cfg.fail_count = before["fail_status"], before["fail_count"]
    # the warm-up took the two injected failures and is not in the records
    assert len(res.records) == 10 and all(r.success for r in res.records)
    assert res.config["mode"] == "rate" and res.config["rate"] == 200.0


def test_failures_and_mid_stream_drops_are_counted(stub):
    url, _ = stub
    res = run_load(
        LoadConfig(url, concurrency=2, num_requests=4, headers={"x-stub-drop-after": "2"}),
        make_workload("random", seed=2, input_len="10", output_len="5", block_size=16),
    )
    assert len(res.records) == 4 and not any(r.success for r in res.records)
    assert all(len(r.chunk_times) == 2 and "after 2 chunks" in r.error for r in res.records)
    res = run_load(
        LoadConfig(url, concurrency=1, num_requests=2, headers={"x-stub-fail-status": "429"}),
        make_workload("random", seed=2, input_len="10", output_len="5", block_size=16),
    )
    assert [r.error.startswith("HTTP 429") for r in res.records] == [True, True]
    s = summarize(res.records, res.duration_s)
    assert s["failed"] == 2 and s["completed"] == 0


def test_trace_replay_on_its_timestamps(stub, tmp_path):
    url, _ = stub
    path = tmp_path / "trace.jsonl"
    write_trace(
        path,
        [
            TraceRecord(0, 16, 2, [1]),
            TraceRecord(200, 32, 3, [1, 2]),
            TraceRecord(400, 16, 1, [3], "s", 0),
            TraceRecord(400, 40, 2, [3, 4, 5], "s", 1, delay=50),
        ],
    )
    res = run_load(
        LoadConfig(url, fixed_schedule=True, time_scale=0.5, num_requests=4, block_size=16),
        make_workload("trace", path=str(path)),
    )
    recs = sorted(res.records, key=lambda r: r.start)
    assert len(recs) == 4 and all(r.success for r in recs)
    # offsets from the run's origin: 200 ms and 400 ms at time scale 0.5 (less the clock's granularity)
    assert recs[1].start >= 0.1 - 0.005
    assert recs[2].start >= 0.2 - 0.005
    assert recs[3].start >= recs[2].end + 0.05
    assert recs[0].prompt_tokens == 16 and recs[1].prompt_tokens == 32
    # the shared block [1] is a real shared prefix: the stub's prefix cache sees it
    assert recs[1].cached_tokens == 16
    assert recs[3].prompt_tokens == 40 and [r.output_tokens for r in recs] == [2, 3, 1, 2]


def test_completions_endpoint_non_streaming_and_duration_bound(stub):
    url, _ = stub
    res = run_load(
        LoadConfig(url, endpoint="completions", stream=False, concurrency=2, num_requests=3),
        make_workload("random", seed=2, input_len="10", output_len="4", block_size=16),
    )
    # non-streaming: the whole answer is one "chunk", so TTFT is when the body arrived
    assert all(
        r.success and r.output_tokens == 4 and len(r.chunk_times) == 1 and r.ttft <= r.e2e
        for r in res.records
    )
    res = run_load(
        LoadConfig(url, concurrency=2, duration_s=0.3),
        make_workload("random", seed=2, input_len="10", output_len="2", block_size=16),
    )
    assert len(res.records) >= 2 and all(r.success for r in res.records)


def test_config_validation():
    with pytest.raises(ValueError, match="bound"):
        LoadConfig("http://x")
    with pytest.raises(ValueError, match="infinite rate"):
        LoadConfig("http://x", rate=math.inf, duration_s=1)


def test_open_loop_cap_bounds_requests_in_flight(stub):
    url, _ = stub
    wl = make_workload(
        "multi-turn", seed=9, turns="2", input_len="8", output_len="2", think_s="0.05", block_size=16
    )
    res = run_load(LoadConfig(url, rate=math.inf, concurrency=2, num_requests=8), wl)
    assert len(res.records) == 8 and all(r.success for r in res.records)
    assert summarize(res.records, res.duration_s)["max_concurrent_requests"] <= 2
