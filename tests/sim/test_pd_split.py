"""The PD split planner: the prefill load each policy puts on the prefill pool moves the split the
way it should, the workload's rounds are read right, and `tokenops plan-pd` prints the plan."""

import dataclasses
import functools
import json

import pytest
from typer.testing import CliRunner

from tokenops.bench.workloads import make_workload
from tokenops.cli import app
from tokenops.cluster.pd import AMPD, Colocated, ConditionalPD, StaticPD
from tokenops.cluster.perf_model import PerfModel
from tokenops.sim.cli import PROFILES
from tokenops.sim.pd_split import SessionLoad, SessionRound, _prefill_hits, pd_split, split_estimate
from tokenops.sim.workload import SimRound, SimSession, sim_sessions

PERF = dataclasses.replace(
    PerfModel.load(PROFILES / "opt-13b-a100-80g-tp1.json"),
    transfer_latency_s=0.001,
    transfer_bytes_per_s=25e9,
)


def load(new_tokens: list[int], rate: float, prompt: int = 4000, out: int = 100) -> SessionLoad:
    rounds = tuple(SessionRound(prompt, n, out, 0.5, out) for n in new_tokens)
    return SessionLoad(rate, rounds, shared_prefix_tokens=2048)


def test_a_heavier_prefill_share_moves_the_split_toward_prefill_workers():
    incremental = StaticPD(PERF, incremental=True)
    light = pd_split(PERF, load([200] * 50, 8.0), incremental, 8, 1.0, 0.1).best
    heavy = pd_split(PERF, load([1500] * 50, 8.0), incremental, 8, 1.0, 0.1).best
    assert heavy.prefill > light.prefill
    # vLLM's path recomputes all but the shared prefix (no KV pool given: no prefill cache to count on)
    whole = pd_split(PERF, load([200] * 50, 8.0), StaticPD(PERF), 8, 1.0, 0.1).best
    assert whole.prefill > light.prefill
    # at one split the heavier share is a busier prefill pool, and the decode pool is the same
    a, b = (split_estimate(PERF, load([n] * 50, 8.0), incremental, 2, 6, 1.0, 0.1) for n in (200, 1500))
    assert b.prefill_utilisation > 3 * a.prefill_utilisation and b.tpot_s == a.tpot_s


def test_a_decode_pool_past_the_profiles_bend_pays_its_wider_base():
    policy = StaticPD(PERF, incremental=True)
    work = load([200] * 50, 8.0)
    line = split_estimate(PERF, work, policy, 2, 4, 1.0, 0.1)
    # a bend below the unbent batch: every step of that batch pays 20 ms more
    wide_from = int(line.decode_batch) - 5
    bent = dataclasses.replace(PERF, wide_from_rows=wide_from, wide_base_s=0.02)
    est = split_estimate(bent, work, policy, 2, 4, 1.0, 0.1)
    assert est.decode_batch > line.decode_batch > wide_from and est.tpot_s > line.tpot_s + 0.02
    # the fixed point: a step of that batch at the rounds' mean context takes that time
    ctx = 4000 + 100 / 2
    assert bent.step_seconds(0, 0.0, est.decode_batch, est.decode_batch * ctx) == pytest.approx(est.tpot_s)
    # a bend above the batch changes nothing
    above = dataclasses.replace(bent, wide_from_rows=int(line.decode_batch) + 5)
    assert split_estimate(above, work, policy, 2, 4, 1.0, 0.1).tpot_s == line.tpot_s


def test_ampds_local_share_moves_the_split_toward_decode_workers():
    # short incremental prefills AMPD can keep inside a decode step, and longer ones it cannot; with
    # the faster way on every tie it keeps the short ones local
    mix = load([300] * 40 + [800] * 10, 10.0)
    ampd = pd_split(PERF, mix, AMPD(PERF, remote_ttft_share=0.0), 8, 1.0, 0.1)
    static = pd_split(PERF, mix, StaticPD(PERF, incremental=True), 8, 1.0, 0.1)
    assert ampd.best.prefill < static.best.prefill
    # by default it sends a round remote while the prefill side has TTFT slack, which the planner's
    # idle prefill worker always has: planned as static PD with the incremental transfer
    default = pd_split(PERF, mix, AMPD(PERF), 8, 1.0, 0.1)
    assert default.best.prefill == static.best.prefill and default.best.local_share == 0.0
    at = {e.prefill: e for e in ampd.splits}
    assert 0.7 <= at[ampd.best.prefill].local_share <= 0.8  # the short rounds, not the long ones
    # the local rule holds at the planned batch: a fuller decode pool keeps fewer local
    shares = [at[p].local_share for p in sorted(at)]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]
    # the prefills it keeps local cost the decode pool: a larger batch than static PD's at the split
    same = split_estimate(PERF, mix, StaticPD(PERF, incremental=True), 2, 6, 1.0, 0.1)
    assert at[2].decode_batch > same.decode_batch and at[2].prefill_utilisation < same.prefill_utilisation


def test_the_decode_pools_kv_bounds_the_split():
    # long contexts: without a KV limit the prefill pool wants more workers than the decode pool's KV allows
    heavy = load([1500] * 50, 5.0, prompt=8000)
    free = pd_split(PERF, heavy, StaticPD(PERF, incremental=True), 8, 1.0, 0.1).best
    bound = pd_split(PERF, heavy, StaticPD(PERF, incremental=True), 8, 1.0, 0.1, kv_tokens=60_000).best
    assert bound.decode > free.decode and bound.kv_utilisation <= 1.0


def test_one_slot_per_prefill_worker_plans_more_prefill_workers():
    # a leg holds its worker's only slot through its history pull too: each worker serves fewer legs
    incremental = StaticPD(PERF, incremental=True)
    free = pd_split(PERF, load([200] * 50, 8.0), incremental, 8, 1.0, 0.1)
    one = pd_split(PERF, load([200] * 50, 8.0), incremental, 8, 1.0, 0.1, prefill_slots=1)
    assert one.best.prefill > free.best.prefill
    at = {e.prefill: e for e in one.splits}
    assert at[2].prefill_utilisation > 2 * {e.prefill: e for e in free.splits}[2].prefill_utilisation
    # many slots: the worker's prefills, not its slots, are what it is short of
    many = pd_split(PERF, load([200] * 50, 8.0), incremental, 8, 1.0, 0.1, prefill_slots=64)
    assert many.splits == free.splits


def test_legs_whose_wait_runs_out_prefill_on_their_decode_workers():
    heavy = load([1500] * 50, 12.0)
    kw = {"prefill_slots": 1, "max_num_batched_tokens": 2048}
    incremental = StaticPD(PERF, incremental=True)
    waits = split_estimate(PERF, heavy, incremental, 1, 7, 1.0, 0.1, **kw)
    assert waits.prefill_utilisation > 1 and waits.ttft_p95_s == float("inf") and waits.local_share == 0
    gives_up = split_estimate(PERF, heavy, incremental, 1, 7, 1.0, 0.1, prefill_wait_s=2.0, **kw)
    # past a full prefill worker the excess gives up: the worker serves at capacity, the rest locally
    assert gives_up.timed_out_share == pytest.approx(1 - 1 / waits.prefill_utilisation)
    assert gives_up.local_share == pytest.approx(gives_up.timed_out_share)
    assert gives_up.prefill_utilisation == 1.0 and gives_up.decode_batch > waits.decode_batch


def test_a_conditional_rule_with_a_higher_threshold_plans_fewer_prefill_workers():
    mix = load([300] * 20 + [800] * 15 + [1500] * 15, 8.0)
    kw = {"max_num_batched_tokens": 2048}
    always = pd_split(PERF, mix, ConditionalPD.llm_d(0), 8, 1.0, 0.1, **kw).best
    long_only = pd_split(PERF, mix, ConditionalPD.llm_d(1000), 8, 1.0, 0.1, **kw).best
    assert long_only.prefill < always.prefill
    assert always.local_share == 0 and long_only.local_share == pytest.approx(0.7)  # the rounds under 1000
    # the local prefills of up to 1000 tokens make steps past the 100 ms gap SLO: the gap bounds the plan
    assert long_only.gap_p95_s > 0.1 and long_only.bottleneck == pytest.approx(long_only.gap_p95_s / 0.1)
    low = pd_split(PERF, mix, ConditionalPD.dynamo(200), 8, 1.0, 0.1, **kw).best
    high = pd_split(PERF, mix, ConditionalPD.dynamo(1000), 8, 1.0, 0.1, **kw).best
    assert high.prefill < low.prefill


def test_dynamos_queue_check_keeps_more_rounds_local_as_the_prefill_pool_shrinks():
    mix = load([300] * 20 + [800] * 15 + [1500] * 15, 8.0)
    plan = pd_split(PERF, mix, ConditionalPD.dynamo(200), 8, 1.0, 0.1, max_num_batched_tokens=2048)
    at = {e.prefill: e for e in plan.splits}
    # one worker is busy enough that its queue is often full: the rule then prefills locally
    assert at[1].local_share > 0.2 and at[1].local_share > at[2].local_share > at[3].local_share
    # llm-d's rule has no queue check: the same share at every split
    llm_d = pd_split(PERF, mix, ConditionalPD.llm_d(200), 8, 1.0, 0.1, max_num_batched_tokens=2048)
    assert {e.local_share for e in llm_d.splits} == {0.0}


def test_vllms_static_pd_loses_a_sessions_cache_when_its_round_moves_to_another_prefill_worker():
    hits = functools.partial(_prefill_hits, PERF, load([200] * 50, 1.0), StaticPD(PERF), remote=[1.0] * 50,
                             tpot=0.03, kv_tokens=10**9)  # fmt: skip
    # a cache that keeps everything: an idle pool sends every round back to its worker, and so does a
    # pool of one worker however busy
    # (the first round in the list has no round before it to have gone remote)
    assert min(hits(lam_p=0.01, prefill=2)[1:]) > 0.99 and min(hits(lam_p=6.0, prefill=1)[1:]) > 0.999
    # a busy pool moves rounds off their worker (its backlog outweighs the saving), more with more workers
    two, four = hits(lam_p=6.0, prefill=2), hits(lam_p=6.0, prefill=4)
    assert max(two) < 0.95 and max(four) < max(two)
    # a round after a local one finds no previous prompt on a prefill worker
    assert hits(lam_p=0.01, prefill=2, remote=[1.0, 0.0] * 25)[2] == 0.0
    # a second worker takes half the legs but makes busy rounds move and recompute their history:
    # each of two workers is busier than one alone (which every session goes back to)
    plan = pd_split(PERF, load([200] * 50, 12.0), StaticPD(PERF), 8, 1.0, 0.1, kv_tokens=2 * 10**5)
    at = {e.prefill: e for e in plan.splits}
    assert at[2].prefill_utilisation > at[1].prefill_utilisation and plan.best.prefill == 3


def test_the_split_planner_refuses_a_policy_it_does_not_model():
    with pytest.raises(ValueError, match="colocated"):
        split_estimate(PERF, load([200], 1.0), Colocated(), 1, 1, 1.0, 0.1)
    with pytest.raises(ValueError, match="two workers"):
        pd_split(PERF, load([200], 1.0), AMPD(PERF), 1, 1.0, 0.1)


def test_pd_split_hands_its_keywords_to_every_split_and_refuses_a_misspelt_one():
    kw = {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "kv_tokens": 60_000, "prefill_slots": 2,
          "prefill_wait_s": 0.5}  # fmt: skip
    mix, policy = load([200, 1500] * 25, 8.0), ConditionalPD.dynamo(1000)
    plan = pd_split(PERF, mix, policy, 4, 1.0, 0.1, **kw)
    each = tuple(split_estimate(PERF, mix, policy, p, 4 - p, 1.0, 0.1, **kw) for p in (1, 2, 3))
    assert plan.splits == each
    assert plan.splits != pd_split(PERF, mix, policy, 4, 1.0, 0.1).splits  # the keywords count
    with pytest.raises(TypeError, match="kv_token"):
        pd_split(PERF, mix, policy, 4, 1.0, 0.1, kv_token=60_000)  # type: ignore[call-arg]


def test_session_load_reads_new_tokens_and_the_shared_prefix_from_the_sessions():
    def session(sid: str, own: int) -> SimSession:
        first = SimRound(64, 10, 0.0, (1, 2, own), (1, 2, own, own + 1))
        later = SimRound(100, 20, 0.3, (1, 2, own, own + 1, own + 2, own + 3), ())
        return SimSession(sid, 0.0, (first, later))

    got = SessionLoad.from_sessions([session("a", 10), session("b", 20)], 0.5, block_size=16)
    assert got.shared_prefix_tokens == 32 and got.rate == pytest.approx(1.0)  # 2 rounds per session
    assert got.rounds[0] == SessionRound(64, 32, 10, 0.0, None)
    assert got.rounds[1] == SessionRound(100, 36, 20, 0.3, 10)  # 100 less the 4 blocks the first left
    wl = make_workload("agentic", seed=1, block_size=16)
    agentic = sim_sessions(wl, num_requests=200, rate=1.0, seed=1, block_size=16, trace_block=16)
    assert SessionLoad.from_sessions(agentic, 1.0).shared_prefix_tokens == 2048  # the agent's system prompt


def test_the_cli_prints_the_plan_and_checks_it_in_the_simulator():
    runner = CliRunner()
    args = ["plan-pd", "--profile", "opt-13b-a100-80g-tp1", "--sessions-per-s", "0.5", "--workers", "4",
            "--requests", "300", "--num-kv-blocks", "3773", "--transfer-ms", "1",
            "--transfer-gb-s", "25"]  # fmt: skip
    res = runner.invoke(app, args, terminal_width=200)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["policy"] == "ampd" and set(out["splits"]) == {"P1D3", "P2D2", "P3D1"}
    assert (
        out["split"] == f"P{out['plan']['prefill']}D{out['plan']['decode']}" and out["split"] in out["splits"]
    )
    assert out["plan"]["bottleneck"] == min(s["bottleneck"] for s in out["splits"].values())
    res = runner.invoke(app, [*args, "--policy", "static_pd", "--check"], terminal_width=200)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["policy"] == "static_pd" and out["simulated_best"] in out["splits"]
    sim = {k: v["simulated"]["slo_attainment"] for k, v in out["splits"].items()}
    assert all(0 <= a <= 1 for a in sim.values())
    assert out["plan_vs_simulated_best"] == pytest.approx(sim[out["split"]] - max(sim.values()))
    res = runner.invoke(app, [*args, "--policy", "conditional_dynamo", "--prefill-slots", "1"],
                        terminal_width=200)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["policy"] == "conditional_dynamo"
    res = runner.invoke(app, [*args, "--prefill-wait-s", "30"], terminal_width=200)
    assert res.exit_code == 2 and "set --prefill-slots" in res.output
    res = runner.invoke(app, [*args, "--policy", "conditional"], terminal_width=200)
    said = " ".join(res.output.replace("│", " ").split())  # the error box wraps at 80 columns
    assert res.exit_code == 2 and "unknown PD policy 'conditional': use one of static, static_pd," in said
    res = runner.invoke(app, [*args, "--policy", "colocated"], terminal_width=200)
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "the split planner takes a policy with a prefill pool" in said
    res = runner.invoke(app, [*args, "--slo", "ttft=1s,speed=3"], terminal_width=200)
    assert res.exit_code == 2 and "unknown SLO metric" in res.output
    res = runner.invoke(app, [*args[:4], "0", *args[5:]], terminal_width=200)
    assert res.exit_code == 2 and "must be positive" in res.output
