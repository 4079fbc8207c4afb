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
    drifting_loads,
    expert_loads,
    expert_perf,
    failure_timeline,
    gpu_hours,
    imbalance,
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


PREFILL = Workload(context_tokens=2304, tpot_slo_s=0.05, prompt_tokens=2048, output_tokens=512)


def test_prefill_is_charged_to_both_layouts():
    """Every output token brings prompt / output prompt tokens through attention, the experts and
    the all-to-all, so both layouts run fewer decode rows per GPU and need more GPUs."""
    assert PREFILL.step_tokens(10) == pytest.approx(50)
    assert PREFILL.step_shape(10).prefill_tokens == pytest.approx(40)
    decode_only = Workload(context_tokens=2304, tpot_slo_s=0.05)
    for model in (MIXTRAL_8X22B, DEEPSEEK_V3):
        load = expert_loads(model.experts)
        group = 16 if model is DEEPSEEK_V3 else 8
        with_prefill = monolithic_group(model, H100, PREFILL, group, load)
        assert (
            with_prefill.rows_per_gpu < monolithic_group(model, H100, decode_only, group, load).rows_per_gpu
        )
        assert with_prefill.step_s <= PREFILL.tpot_slo_s
        eaas = plan_eaas(model, H100, PREFILL, 40000, 2, load)
        assert eaas.step_s <= PREFILL.tpot_slo_s
        assert eaas.gpus > plan_eaas(model, H100, decode_only, 40000, 2, load).gpus


def test_drifting_loads_move_the_hot_experts_and_re_placement_follows_them():
    """The hot experts of 04:00 are not those of 16:00; a placement made once at the start of the
    day serves the afternoon unevenly, one re-made from the last interval's loads does not, and
    the EaaS fleet needs fewer GPU-hours with it."""
    loads = drifting_loads(MIXTRAL_8X22B.experts, 48, interval_s=1800)
    assert all(sum(x) == pytest.approx(MIXTRAL_8X22B.experts) for x in loads)
    hottest = [max(range(len(x)), key=x.__getitem__) for x in loads]
    assert hottest[7] != hottest[31]  # 04:00 and 16:00
    once = place_experts(loads[0], 4, 4)
    assert imbalance(once, loads[0]) == pytest.approx(once.imbalance)
    assert imbalance(once, loads[31]) > imbalance(place_experts(loads[30], 4, 4), loads[31])
    demand = diurnal(40000, interval_s=1800)
    static = gpu_hours(MIXTRAL_8X22B, H100, PREFILL, demand, 1800, 8, loads=loads, replace_every=None)
    moving = gpu_hours(MIXTRAL_8X22B, H100, PREFILL, demand, 1800, 8, loads=loads, replace_every=1)
    assert moving["eaas_gpu_hours"] < static["eaas_gpu_hours"]
    # eight experts on a group of eight GPUs: one each, nothing for a placement to move
    assert moving["monolithic_gpu_hours"] == static["monolithic_gpu_hours"]


def test_placement_keeps_a_floor_of_replicas_under_skew():
    """A skewed load gives its extra slots to the hot experts, never below `min_replicas` for the
    cold ones (EaaS's failover needs a second replica of every expert)."""
    load = [30.0] + [1.0] * 15
    assert min(place_experts(load, 8, 4).replicas) == 1
    p = place_experts(load, 8, 5, min_replicas=2)
    assert min(p.replicas) == 2 and p.replicas[0] == 8
