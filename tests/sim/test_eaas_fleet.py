"""The fleet-scale EaaS model's invariants: plans meet the SLO with the fewest GPUs the model allows,
replicas cover every expert, monolithic fleets come in whole groups, and a failure costs what its
layout says (a halted group's share; nothing when an expert server's replicas have the headroom)."""

import math

import pytest

from tokenops.cluster.expert_placement import place_experts
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.eaas import (
    DEEPSEEK_V3,
    H100,
    MIXTRAL_8X22B,
    ExpertUnavailable,
    Workload,
    attention_perf,
    client_busy,
    diurnal,
    expert_loads,
    expert_perf,
    failure_timeline,
    gpu_hours,
    monolithic_group,
    plan_eaas,
    plan_monolithic,
    server_times,
    sync_time,
)

WL = Workload(context_tokens=2048, tpot_slo_s=0.05)


def test_step_times_are_the_one_performance_model():
    assert isinstance(attention_perf(DEEPSEEK_V3, H100), PerfModel)
    e = expert_perf(DEEPSEEK_V3, H100, 10)
    # holding twice the experts reads twice the weights per step
    assert expert_perf(DEEPSEEK_V3, H100, 20).base_s == pytest.approx(2 * e.base_s)
    # DeepSeek-V3's routed experts are 653.9B of its 671B parameters (FP8: a byte each)
    assert DEEPSEEK_V3.routed_bytes / 1e9 == pytest.approx(653.9, abs=0.1)


def test_a_group_too_small_for_the_weights_is_refused_and_a_fitting_one_meets_the_slo():
    with pytest.raises(ValueError, match="cannot hold"):
        monolithic_group(DEEPSEEK_V3, H100, WL, 8)
    g = monolithic_group(DEEPSEEK_V3, H100, WL, 16)
    assert g.step_s <= WL.tpot_slo_s
    assert g.tokens_per_s == pytest.approx(16 * g.rows_per_gpu / g.step_s)
    assert plan_monolithic(g, g.tokens_per_s * 2.5) == 3 * 16  # whole groups only


@pytest.mark.parametrize("demand", [3000, 40000])
def test_an_eaas_plan_meets_the_slo_with_every_expert_replicated_and_no_server_to_spare(demand):
    load = expert_loads(MIXTRAL_8X22B.experts)
    p = plan_eaas(MIXTRAL_8X22B, H100, WL, demand, min_replicas=2, load=load)
    assert p.step_s <= WL.tpot_slo_s
    assert p.tokens_per_s >= demand
    assert min(p.placement.replicas) >= 2
    assert p.clients == math.ceil(demand * WL.tpot_slo_s / p.rows_per_client)
    # one server fewer either cannot hold two replicas of every expert or misses the SLO
    fewer = p.servers - 1
    per_server = int(H100.memory_bytes * H100.usable_memory // MIXTRAL_8X22B.expert_column_bytes)
    if fewer < 2 or fewer * per_server < 2 * MIXTRAL_8X22B.experts:
        return
    placement = place_experts(load, fewer, math.ceil(2 * MIXTRAL_8X22B.experts / fewer))
    if min(placement.replicas) < 2:
        return
    rows = p.clients * p.rows_per_client
    busiest = max(server_times(MIXTRAL_8X22B, H100, placement, load, rows, [True] * fewer))
    attn = attention_perf(MIXTRAL_8X22B, H100)
    step = max(client_busy(MIXTRAL_8X22B, H100, WL, attn, p.rows_per_client), busiest)
    assert step + sync_time(MIXTRAL_8X22B, H100) > WL.tpot_slo_s


def test_eaas_gpus_grow_with_demand_and_follow_it_more_finely_than_groups():
    demand = diurnal(60000, hours=24, interval_s=3600)
    r = gpu_hours(MIXTRAL_8X22B, H100, WL, demand, 3600, 16)
    eaas = r["eaas_gpus"]
    order = sorted(range(len(demand)), key=lambda i: demand[i])
    assert [eaas[i] for i in order] == sorted(eaas)
    assert all(g % 16 == 0 for g in r["monolithic_gpus"])
    assert len(set(eaas)) > len(set(r["monolithic_gpus"]))


def test_losing_a_server_never_speeds_the_rest_up_and_a_lone_replica_is_unavailable():
    load = expert_loads(MIXTRAL_8X22B.experts)
    p = plan_eaas(MIXTRAL_8X22B, H100, WL, 20000, min_replicas=2, load=load)
    rows = p.clients * p.rows_per_client
    alive = [True] * p.servers
    before = max(server_times(MIXTRAL_8X22B, H100, p.placement, load, rows, alive))
    alive[0] = False
    assert max(server_times(MIXTRAL_8X22B, H100, p.placement, load, rows, alive)) >= before
    single = plan_eaas(MIXTRAL_8X22B, H100, WL, 20000, min_replicas=1, load=load)
    if min(single.placement.replicas) == 1:
        lone = next(s for s, held in enumerate(single.placement.servers)
                    if any(single.placement.replicas[e] == 1 for e in held))  # fmt: skip
        alive = [s != lone for s in range(single.servers)]
        with pytest.raises(ExpertUnavailable):
            server_times(MIXTRAL_8X22B, H100, single.placement, load, rows, alive)


def test_a_failure_halts_a_monolithic_group_but_not_an_eaas_fleet_with_a_spare():
    f = failure_timeline(MIXTRAL_8X22B, H100, WL, 40000, 16, fail_at_s=60, recover_after_s=120,
                         duration_s=300, bin_s=10, spare=True)  # fmt: skip
    assert f["eaas_degraded_step_s"] <= WL.tpot_slo_s
    assert f["eaas_dip"] == pytest.approx(0.0, abs=0.01)
    # the surviving groups absorb what their rows allow; a lone group stops altogether
    group_tps = f["group"].tokens_per_s
    expected = 1 - min(40000, (f["groups"] - 1) * group_tps) / 40000
    assert f["monolithic_dip"] == pytest.approx(expected, abs=0.02)
    assert f["monolithic_dip"] > 0
