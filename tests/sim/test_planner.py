"""The capacity planner's MILP on hand-checked instances, its queueing estimates, and load following."""

import math

import pytest

from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.planner import (
    Candidate,
    Load,
    ReplicaType,
    candidates,
    decode_tpot,
    follow_load,
    forecast_rate,
    plan,
    prefill_p95,
    solve,
)  # fmt: skip

P = [Candidate("prefill", "A", n, n, lat) for n, lat in ((1, 2.0), (2, 1.0), (3, 0.7))]
D = [Candidate("decode", "B", 1, 2, 1.5), Candidate("decode", "B", 2, 4, 0.8)]


def test_milp_picks_the_hand_computed_optimum_and_breaks_ties_by_fewer_gpus():
    # budget 5: P2+D1 (4 GPUs, max(1.0, 1.5) = 1.5) ties P3+D1 (5 GPUs); P1+D2 gives 2.0
    got = solve(P + D, 5, 1.0, 1.0)
    assert (got.prefill.count, got.decode.count, got.gpus) == (2, 1, 4)
    assert got.bottleneck == pytest.approx(1.5)
    # budget 6: P2+D2 (6 GPUs), bottleneck max(1.0, 0.8) = 1.0
    got = solve(P + D, 6, 1.0, 1.0)
    assert (got.prefill.count, got.decode.count) == (2, 2) and got.bottleneck == pytest.approx(1.0)
    # SLOs rescale the pools: a loose TTFT SLO makes decode the bottleneck, so buy decode first
    got = solve(P + D, 5, 10.0, 1.0)
    assert (got.prefill.count, got.decode.count) == (1, 2) and got.bottleneck == pytest.approx(0.8)
    assert solve(P + D, 2, 1.0, 1.0) is None  # no prefill + decode pair fits 2 GPUs


def test_milp_matches_brute_force_over_a_generated_instance():
    perf = PerfModel(base_s=0.02, per_token_s=1e-4, prefill_attention_s=1e-8, decode_attention_s=1e-7)
    big = PerfModel(base_s=0.012, per_token_s=5e-5, prefill_attention_s=5e-9, decode_attention_s=5e-8)
    types = [ReplicaType("tp1", perf, 1), ReplicaType("tp2", big, 2)]
    load = Load(rate=20.0, prompt_tokens=1000, output_tokens=200)
    cands = candidates(types, load, 16)
    best = min(
        (max(p.latency_s / 0.5, d.latency_s / 0.05), p.gpus + d.gpus)
        for p in cands if p.role == "prefill" for d in cands if d.role == "decode" if p.gpus + d.gpus <= 16
    )  # fmt: skip
    got = plan(types, load, 16, 0.5, 0.05)
    assert got.bottleneck == pytest.approx(best[0], rel=1e-6) and got.gpus == best[1]


def test_queueing_estimates_grow_with_load_and_diverge_past_capacity():
    perf = PerfModel(base_s=0.02, per_token_s=1e-4, decode_attention_s=1e-7)
    load = Load(rate=10.0, prompt_tokens=500, output_tokens=100)
    assert prefill_p95(perf, load, 2) < prefill_p95(perf, load, 1)
    assert math.isinf(prefill_p95(perf, Load(100.0, 500, 100), 1))  # 70 ms a prefill: 14/s at most
    assert decode_tpot(perf, load, 4, 256) < decode_tpot(perf, load, 1, 256)
    # tpot = base / (1 - k * lambda * out), k = 1e-4 + 1e-7 * 550
    k = 1e-4 + 1e-7 * 550
    assert decode_tpot(perf, load, 1, 256) == pytest.approx(0.02 / (1 - k * 10 * 100))


def test_a_decode_pool_past_the_profiles_bend_pays_its_wider_base():
    # a decode step of 40 rows or more takes the other path: 10 ms more a step
    bent = PerfModel(base_s=0.004, per_token_s=6e-4, wide_from_rows=40, wide_base_s=0.01)
    k = 6e-4
    for rate, wide in ((10.0, False), (15.0, True)):
        load = Load(rate=rate, prompt_tokens=200, output_tokens=100, context_tokens=0)
        tpot = decode_tpot(bent, load, 1, 512)
        base = 0.004 + (0.01 if wide else 0.0)
        assert tpot == pytest.approx(base / (1 - k * rate * 100))
        # the fixed point: the step of the batch Little's law gives takes that time, on its side of the bend
        batch = rate * 100 * tpot
        assert (batch >= 40) is wide
        assert bent.step_seconds(0, 0.0, batch, 0) == pytest.approx(tpot)
    # the unbent line would put the busier pool's batch past the bend, where its steps are slower
    load = Load(rate=15.0, prompt_tokens=200, output_tokens=100, context_tokens=0)
    line = decode_tpot(PerfModel(base_s=0.004, per_token_s=6e-4), load, 1, 512)
    assert 15 * 100 * line >= 40 and decode_tpot(bent, load, 1, 512) > 3 * line


def test_load_following_forecasts_the_trend_and_plans_more_for_more():
    assert forecast_rate([10, 12, 14, 16]) > 16
    assert forecast_rate([10, 10, 10]) == pytest.approx(10)
    perf = PerfModel(base_s=0.02, per_token_s=1e-4, decode_attention_s=1e-7)
    types = [ReplicaType("cpu", perf, 1)]
    load = Load(rate=1.0, prompt_tokens=500, output_tokens=100)
    low_rate, low = follow_load(types, [5, 5, 5], load, 64, 0.5, 0.05)
    high_rate, high = follow_load(types, [5, 10, 20], load, 64, 0.5, 0.05)
    assert high_rate > low_rate
    assert high.gpus > low.gpus
