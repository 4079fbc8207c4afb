"""The engine model against hand-computed step times (one request alone, chunked prefill, the prefix
cache, batch limits, preemption when KV runs out, a prefill/decode split with a KV transfer), and
against the engine's own scheduler and block pool: hand-built cases and random workloads replayed on
them (engine_replay.py)."""

import random

import pytest

from tokenops.bench.traces import TraceRecord
from tokenops.cluster.pd import StaticPD
from tokenops.cluster.perf_model import PerfModel, StepShape
from tokenops.sim.engine_model import EngineShape
from tokenops.sim.fleet import Fleet, FleetConfig
from tokenops.sim.workload import SimSession, to_sim_session

from .engine_replay import (
    PERF,
    Case,
    ReplicaLog,
    block_tokens,
    engine_scheduler,
    engine_seq,
    replay,
    step_to_end,
)


def _session(i: int, prompt: int, out: int, at: float = 0.0, shared: int = 0) -> SimSession:
    """One single-round session; `shared` leading 16-token blocks come from a common prefix."""
    blocks = -(-prompt // 16)
    ids = list(range(shared)) + [10_000 * (i + 1) + b for b in range(blocks - shared)]
    return to_sim_session([TraceRecord(0, prompt, out, ids, f"s{i}")], at, 16, 16, i)


def _run(sessions, shape=None, replicas=1, **kw):
    shape = shape or EngineShape()
    fleet = Fleet(
        FleetConfig(PERF, shape, replicas=replicas, poll_interval_s=None, **kw.pop("cfg", {})), **kw
    )
    return fleet, fleet.run(sessions)


def test_one_request_alone_takes_a_prefill_step_then_one_decode_step_per_token():
    fleet, res = _run([_session(0, 100, 5)])
    (rec,) = res.records
    ttft = PERF.step_time(StepShape.prefill(100))
    assert rec.ttft == pytest.approx(ttft)
    # token k (k >= 1) is fed with context 100 + k
    gaps = [PERF.decode_step_time(1, 100 + k) for k in range(1, 5)]
    assert rec.itl == pytest.approx(gaps)
    assert rec.output_len == 5 and rec.e2e == pytest.approx(ttft + sum(gaps))
    w = fleet.workers[0]
    assert w.used_private == 0 and not w.in_use  # every block given back


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    shape = EngineShape(max_num_batched_tokens=256, max_num_seqs=8, max_prefill_step_tokens=256)
    _, res = _run([_session(0, 1000, 2)], shape)
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    expect = sum(PERF.step_time(StepShape.prefill(n, c)) for n, c in chunks)
    assert res.records[0].ttft == pytest.approx(expect)


def test_with_no_decode_running_a_prefill_takes_the_prefill_step_budget():
    """Alone, a 1,000-token prompt runs in chunks of `max_prefill_step_tokens` (600), not of the 256
    budget; a prompt that arrives while another decodes keeps the 256 budget."""
    shape = EngineShape(max_num_batched_tokens=256, max_num_seqs=8, max_prefill_step_tokens=600)
    _, res = _run([_session(0, 1000, 2)], shape)
    chunks = [(600, 0), (400, 600)]
    expect = sum(PERF.step_time(StepShape.prefill(n, c)) for n, c in chunks)
    assert res.records[0].ttft == pytest.approx(expect)
    # a chunk cap bounds the first prefill's chunk, and so the step
    capped = EngineShape(max_num_batched_tokens=256, max_num_seqs=8, max_prefill_step_tokens=600,
                         max_chunk_tokens=300)  # fmt: skip
    _, res = _run([_session(0, 1000, 2)], capped)
    chunks = [(300, 0), (300, 300), (300, 600), (100, 900)]
    expect = sum(PERF.step_time(StepShape.prefill(n, c)) for n, c in chunks)
    assert res.records[0].ttft == pytest.approx(expect)
    # the second prompt arrives while the first decodes its 50 tokens: 256-token chunks beside them
    _, res = _run([_session(0, 100, 50), _session(1, 1000, 2, 0.05)], shape)
    second = max(res.records, key=lambda r: r.start)
    assert second.ttft > sum(PERF.step_time(StepShape.prefill(n, c)) for n, c in [(600, 0), (400, 600)])


def test_a_shared_prefix_is_served_from_the_prefix_cache_the_second_time():
    # 32 shared blocks = 512 tokens; the second request arrives after the first finished
    _, res = _run([_session(0, 600, 2, 0.0, shared=32), _session(1, 600, 2, 5.0, shared=32)])
    first, second = sorted(res.records, key=lambda r: r.start)
    assert first.cached_tokens == 0 and second.cached_tokens == 512
    assert second.ttft == pytest.approx(PERF.step_time(StepShape.prefill(600 - 512, 512)))
    _, off = _run(
        [_session(0, 600, 2, 0.0, 32), _session(1, 600, 2, 5.0, 32)], EngineShape(enable_prefix_caching=False)
    )
    assert all(r.cached_tokens == 0 for r in off.records)


def test_max_num_seqs_bounds_the_batch_and_the_rest_wait():
    shape = EngineShape(max_num_seqs=2, max_num_batched_tokens=1024)
    fleet, res = _run([_session(i, 64, 20) for i in range(4)], shape)
    by_start = sorted(res.records, key=lambda r: r.ttft)
    # the third and fourth start only after the first two finish
    assert by_start[2].ttft > max(by_start[0].e2e, by_start[1].e2e) - 1e-9
    assert fleet.workers[0].decode_tokens == 4 * 19


def test_kv_exhaustion_preempts_and_every_request_still_completes_with_its_tokens():
    shape = EngineShape(max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=40)
    fleet, res = _run([_session(i, 100, 120) for i in range(8)], shape)
    w = fleet.workers[0]
    assert w.preemptions > 0
    assert sorted(r.output_len for r in res.records) == [120] * 8
    assert all(len(r.chunk_times) == 120 for r in res.records)
    assert all(b >= a for r in res.records for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False))
    assert w.used_private == 0 and not w.in_use
    assert len(w.cached) <= w.total_blocks


def test_static_pd_prefills_remotely_and_pays_the_transfer():
    sessions = [_session(0, 300, 4)]
    fleet, res = _run(sessions, replicas=1, pd_policy=StaticPD(PERF), cfg={"prefill_replicas": 1})
    (rec,) = res.records
    prefill = PERF.step_time(StepShape.prefill(300))
    # as the live decode leg: the 18 whole blocks arrive, the decode worker computes the last 12 tokens
    # and samples the first token itself
    tail = PERF.step_time(StepShape(12, 12 * (288 + 6), 0, 0))
    assert rec.ttft == pytest.approx(prefill + PERF.transfer_time(300) + tail)
    assert len(rec.chunk_times) == 4
    stats = res.replicas
    assert stats["p0"]["prefill_tokens"] == 300 and stats["p0"]["decode_tokens"] == 0
    assert stats["d0"]["prefill_tokens"] == 12 and stats["d0"]["decode_tokens"] == 3


def test_host_contention_slows_a_step_only_while_a_neighbour_has_work():
    from tokenops.sim.fleet import Fleet, FleetConfig
    from tokenops.sim.workload import SimRound, SimSession

    perf = PerfModel(name="t", base_s=0.1, per_token_s=0.001)

    def first_tokens(contention: float, gap_s: float) -> list[float]:
        # two one-token requests: round robin puts one on each replica, `gap_s` apart
        sessions = [SimSession(f"s{i}", i * gap_s, (SimRound(100, 1, 0.0, (), ()),)) for i in range(2)]
        cfg = FleetConfig(perf, replicas=2, poll_interval_s=None, host_contention=contention)
        res = Fleet(cfg).run(sessions)
        return [r.ttft for r in sorted(res.records, key=lambda r: r.start)]

    alone = perf.prefill_time(100)
    # apart: neither step overlaps the other replica's work, so contention changes nothing
    assert first_tokens(0.5, 10.0) == pytest.approx([alone, alone])
    # together: each step starts with the other replica holding work, so both take 1.5x
    assert first_tokens(0.5, 0.0) == pytest.approx([1.5 * alone, 1.5 * alone])
    assert first_tokens(0.0, 0.0) == pytest.approx([alone, alone])


def test_events_given_up_front_run_in_the_order_of_one_at_call_each() -> None:
    from tokenops.sim.events import EventLoop

    def trace(bulk: bool) -> list:
        loop, seen = EventLoop(), []
        loop.at(1.0, seen.append, "first at 1.0")
        arrivals = [(2.0, seen.append, "b"), (1.0, seen.append, "a"), (2.0, seen.append, "c"),
                    (0.5, seen.append, "z")]  # fmt: skip
        if bulk:
            loop.at_each(arrivals)
        else:
            for t, fn, arg in arrivals:
                loop.at(t, fn, arg)
        loop.at(2.0, seen.append, "last at 2.0")
        loop.at(1.0, lambda _: loop.at(2.0, seen.append, "scheduled during the run"), None)
        loop.run()
        return [seen, loop.events_run, loop.now]

    assert trace(bulk=True) == trace(bulk=False)
    assert trace(bulk=True)[0] == ["z", "first at 1.0", "a", "b", "c", "last at 2.0",
                                   "scheduled during the run"]  # fmt: skip
    loop = EventLoop()
    loop.at(1.0, lambda _: None)
    loop.run()
    with pytest.raises(ValueError):
        loop.at_each([(0.5, print, None)])


# -- the prefill queue on a PD fleet's prefill worker ----------------------------------------------


def _legs(sessions, queue: bool, max_deferrals: int = 3, slo: float = 2.0):
    """One prefill and one decode worker, one prefill leg at a time; the order legs that waited for
    the slot were let through, by session, and each session's TTFT."""
    cfg = {"prefill_replicas": 1, "prefill_slots": 1, "prefill_queue": queue,
           "prefill_max_deferrals": max_deferrals, "ttft_slo_s": slo}  # fmt: skip
    fleet, res = _run(sessions, replicas=1, pd_policy=StaticPD(PERF), cfg=cfg, record_decisions=True)
    session_of = {job.request_id: job.session_id for job, _, _ in res.decisions}
    order = [session_of[job_id] for _, _, job_id in fleet.leg_releases]
    return order, {r.session_id: r.ttft for r in res.records}


def test_the_simulated_prefill_queue_lets_the_least_slack_leg_through_first():
    # s0 holds the slot for about a second; two short prompts and then a long one wait for it. First
    # come first served takes the shorts first; the queue takes the long one, whose slack is least
    sessions = [_session(0, 1000, 2), _session(1, 50, 2, at=0.1), _session(2, 50, 2, at=0.2),
                _session(3, 800, 2, at=0.3)]  # fmt: skip
    fcfs, fcfs_ttft = _legs(sessions, queue=False)
    ordered, ordered_ttft = _legs(sessions, queue=True)
    assert fcfs == ["s1", "s2", "s3"]
    assert ordered == ["s3", "s1", "s2"]
    # the long prompt's first token comes sooner, the shorts' later, and all still meet the 2 s SLO
    # the queue weighed them against
    assert ordered_ttft["s3"] < fcfs_ttft["s3"] - 0.1
    assert min(ordered_ttft["s1"], ordered_ttft["s2"]) > max(fcfs_ttft["s1"], fcfs_ttft["s2"]) + 0.5
    assert max(ordered_ttft.values()) < 2.0
    assert ordered_ttft["s0"] == fcfs_ttft["s0"]  # the leg that never waited is untouched


def test_the_simulated_prefill_queue_takes_a_leg_passed_over_max_deferrals_times_next():
    # a prompt too long to meet the SLO waits ahead of five short ones: the queue passes it over for
    # every short one that can still meet it, unless the deferral bound says it goes next
    sessions = [_session(0, 1000, 2), _session(1, 3000, 2, at=0.05)] + [
        _session(2 + i, 50, 2, at=0.1 + 0.05 * i) for i in range(5)
    ]
    starved, starved_ttft = _legs(sessions, queue=True, max_deferrals=10)
    bounded, bounded_ttft = _legs(sessions, queue=True, max_deferrals=2)
    assert starved == ["s2", "s3", "s4", "s5", "s6", "s1"]
    assert bounded == ["s2", "s3", "s1", "s4", "s5", "s6"]
    # the bound starts the long prompt earlier, and the short ones behind it pay for that
    assert bounded_ttft["s1"] < starved_ttft["s1"]
    assert min(bounded_ttft[f"s{i}"] for i in (4, 5, 6)) > max(starved_ttft[f"s{i}"] for i in (4, 5, 6))
    # no deferral allowed: first come first served, as without the queue
    assert _legs(sessions, queue=True, max_deferrals=0)[0] == _legs(sessions, queue=False)[0]


def test_the_decode_workers_streams_in_the_pd_snapshot_are_its_answers_as_far_as_each_has_come():
    # the first session's answer is decoding on d0 when the second is placed: the policy's snapshot
    # shows it with the gaps its tokens have had so far and the tokens it has left, as a gateway
    # relaying it would count them
    sessions = [_session(0, 100, 40), _session(1, 100, 5, at=0.2)]
    fleet, res = _run(sessions, pd_policy=StaticPD(PERF), record_decisions=True, cfg={"prefill_replicas": 1})
    first = next(r for r in res.records if r.output_len == 40)
    job, snap, _ = fleet.decisions[1]
    (stream,) = snap.decode[0].streams
    emitted = [t for t in first.chunk_times if t <= job.arrived_at]
    assert (stream.gaps, stream.remaining) == (len(emitted) - 1, 40 - len(emitted))
    assert stream.elapsed_s == pytest.approx(emitted[-1] - emitted[0])
    assert snap.prefill[0].streams == ()


def _engine_run(prompts: list[list[int]], shape: EngineShape, max_tokens: int) -> tuple[int, int, list[int]]:
    """The engine's own scheduler on block-level prompts, all queued at once: its steps, prompt tokens
    computed and each request's cached tokens."""
    sched = engine_scheduler(shape)
    seqs = [engine_seq(i, block_tokens(blocks), max_tokens) for i, blocks in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    steps, prefill = step_to_end(sched)
    return steps, prefill, [s.num_cached_tokens for s in seqs]


def _engine_in_turn(prompts: list[list[int]], shape: EngineShape, max_tokens: int) -> list[int]:
    """The engine's scheduler on block-level prompts, each run to its end before the next is added:
    each request's cached tokens."""
    sched = engine_scheduler(shape)
    cached = []
    for i, blocks in enumerate(prompts):
        seq = engine_seq(i, block_tokens(blocks), max_tokens)
        sched.add(seq)
        step_to_end(sched)
        cached.append(seq.num_cached_tokens)
    return cached


def _blocks(i: int, shared: int, own: int) -> list[int]:
    return list(range(shared)) + [10_000 * (i + 1) + b for b in range(own)]


@pytest.mark.parametrize(
    ("seeds", "max_rounds", "spread_s"),
    [
        (range(0, 150), 1, 0.0),
        ((613, 1351, 1390), 1, 0.0),
        (range(0, 150), 1, 3.0),
        (range(0, 150), 3, 0.0),
        (range(0, 300), 3, 2.0),
    ],
)
def test_random_workloads_run_step_for_step_as_in_the_engine(seeds, max_rounds, spread_s, monkeypatch):
    # small pools, budgets and chunks, shared heads, preemptions and multi-round sessions, queued
    # together or arriving over a few seconds: steps, prompt tokens computed, cached tokens, answer
    # lengths and preemptions all equal the engine's own scheduler's. Seeds 613, 1351 and 1390 are
    # where a decode row preempted by a prefill gives its token back to the budget; 166 and 248 (of
    # three rounds) where rows that finish in a step are freed before the step's prefills
    # (which decides their blocks' place in the LRU)
    log = ReplicaLog()
    log.install(monkeypatch)
    for seed in seeds:
        case = Case.draw(seed, max_rounds, spread_s)
        log.clear()
        sims = case.simulated()
        fleet, res = _run(sims, case.shape)
        w = fleet.workers[0]
        answers = {(r.session_id, r.round): (r.cached_tokens, r.output_tokens) for r in res.records}
        sim = (w.steps, w.prefill_tokens, w.preemptions, answers)
        assert sim == replay(case, sims, log, w.id), (seed, case)


def test_a_sequence_never_outgrows_the_pool_as_in_the_engine():
    # a 240-token prompt asking for 32 more in a 16-block pool: the engine ends it at 256 tokens
    # ("length"); a prompt as long as the pool is refused. Before, the replica stalled and lost both.
    shape = EngineShape(num_kv_blocks=16, max_num_batched_tokens=64, max_chunk_tokens=48)
    fleet, res = _run([_session(0, 240, 32), _session(1, 16, 32, 1.0), _session(2, 256, 4, 2.0)], shape)
    records = sorted(res.records, key=lambda r: r.session_id)
    assert [r.success for r in records] == [True, True, False]
    assert [r.output_tokens for r in records[:2]] == [16, 32]
    assert records[2].error.startswith("400")
    sched = engine_scheduler(shape)
    seqs = [engine_seq(i, block_tokens(_blocks(i, 0, own)), 32) for i, own in enumerate((15, 1))]
    for seq in seqs:
        sched.add(seq)
    step_to_end(sched)
    assert [len(s.output_token_ids) for s in seqs] == [16, 32]


def test_requests_arriving_together_share_their_prefix_step_for_step_as_the_engine_does():
    # 6 requests at once: 20 shared blocks (320 tokens), then 4 blocks of their own. The first
    # prefills the prefix; the others wait a step, then all take it from the cache in one step.
    shape = EngineShape(max_num_batched_tokens=512, max_num_seqs=8)
    fleet, res = _run([_session(i, 384, 4, 0.0, shared=20) for i in range(6)], shape)
    w = fleet.workers[0]
    by_request = [r.cached_tokens for r in sorted(res.records, key=lambda r: r.session_id)]
    assert by_request == [0] + [320] * 5
    assert w.prefill_tokens == 384 + 5 * 64 and w.steps == 5
    assert _engine_run([_blocks(i, 20, 4) for i in range(6)], shape, 4) == (5, w.prefill_tokens, by_request)


def test_a_request_waiting_for_a_shared_head_lets_the_others_go_ahead_as_in_the_engine():
    # r0's 40 blocks prefill in chunks of 16; r1 shares its first 24 and waits for them while r0
    # computes them; r2, behind r1 and sharing nothing, does not wait behind it
    shape = EngineShape(max_num_batched_tokens=20 * 16, max_chunk_tokens=16 * 16, max_num_seqs=8)
    sessions = [
        _session(0, 40 * 16, 2, 0.0, shared=24),
        _session(1, 32 * 16, 2, 0.0, shared=24),
        _session(2, 4 * 16, 2, 0.0),
    ]
    fleet, res = _run(sessions, shape)
    w = fleet.workers[0]
    records = sorted(res.records, key=lambda r: r.session_id)
    assert [r.cached_tokens for r in records] == [0, 24 * 16, 0]
    assert records[2].ttft < records[1].ttft  # the unrelated request started first
    engine = _engine_run([_blocks(0, 24, 16), _blocks(1, 24, 8), _blocks(2, 0, 4)], shape, 2)
    assert engine == (w.steps, w.prefill_tokens, [r.cached_tokens for r in records])


def test_a_prefix_is_shared_while_the_request_that_computed_it_still_runs():
    # the second request arrives while the first is still decoding: the prefix's blocks are cached
    # since the first's prefill, not only once it finishes
    fleet, res = _run([_session(0, 600, 50, 0.0, shared=32), _session(1, 600, 2, 0.2, shared=32)])
    first, second = sorted(res.records, key=lambda r: r.start)
    assert second.start < first.start + first.e2e  # the first is still running
    assert first.cached_tokens == 0 and second.cached_tokens == 512
    w = fleet.workers[0]
    assert w.used_private == 0 and not w.in_use  # every block given back


def test_a_step_sets_aside_at_most_as_many_waiting_requests_as_the_engine():
    from tokenops.engine import scheduler
    from tokenops.sim import engine_model

    assert engine_model.MAX_DEFERRED_PER_STEP == scheduler.MAX_DEFERRED_PER_STEP
    # 20 requests share r0's head while r0 computes it in chunks, then one shares nothing: past the
    # limit the step stops looking, so the last waits behind them, in the engine as in the sim
    shape = EngineShape(max_num_batched_tokens=20 * 16, max_chunk_tokens=16 * 16, max_num_seqs=32)
    prompts = [_blocks(0, 24, 16)] + [_blocks(i, 24, 2) for i in range(1, 21)] + [_blocks(21, 0, 2)]
    sessions = [_session(i, len(b) * 16, 2, 0.0, shared=24 if i < 21 else 0) for i, b in enumerate(prompts)]
    fleet, res = _run(sessions, shape)
    w = fleet.workers[0]
    records = sorted(res.records, key=lambda r: int(r.session_id[1:]))
    assert records[-1].ttft > records[0].ttft  # not admitted beside r0's first chunks
    engine = _engine_run(prompts, shape, 2)
    assert engine == (w.steps, w.prefill_tokens, [r.cached_tokens for r in records])


@pytest.mark.parametrize("seed", [*range(8), 37, 141])
def test_random_fleets_give_every_block_back(seed):
    # random shapes, prompts sharing heads and KV pressure (preemption while requests set aside let
    # later ones start first): when the run ends no replica holds a block
    from tokenops.cluster.policies import PrefixAware

    rng = random.Random(seed)
    shape = EngineShape(
        max_num_batched_tokens=rng.choice([64, 128, 512]),
        max_num_seqs=rng.randint(2, 16),
        num_kv_blocks=rng.randint(40, 200),
        max_chunk_tokens=rng.choice([None, 32, 48]),
    )
    sessions, t = [], 0.0
    for i in range(rng.randint(5, 40)):
        t += rng.expovariate(20)
        prompt = rng.randint(1, 600)
        shared = min(-(-prompt // 16), rng.choice([0, 0, 8, 20, 30]))
        sessions.append(_session(i, prompt, rng.randint(1, 60), t, shared=shared))
    replicas = rng.randint(1, 2)
    if seed % 2:
        cfg = {"exact_index": True}
        fleet, res = _run(sessions, shape, replicas=replicas, cfg=cfg, policy=PrefixAware(learn=False))
    else:
        fleet, res = _run(sessions, shape, replicas=replicas)
    assert len(res.records) == len(sessions)
    for w in fleet.workers:
        assert w.used_private == 0 and not w.in_use


def _importing_worker(num_kv_blocks: int):
    from tokenops.cluster.policies import PrefixAware

    fleet = Fleet(
        FleetConfig(
            PERF, EngineShape(num_kv_blocks=num_kv_blocks), replicas=1, poll_interval_s=None, exact_index=True
        ),
        policy=PrefixAware(learn=False),
    )
    return fleet.workers[0], fleet.policy.index


def test_an_import_never_evicts_its_own_head_and_is_evicted_from_its_end():
    # the engine's import_kv on the same pools (tests/engine/test_kv_transfer.py) keeps the same blocks
    chain = list(range(1000, 1012))
    w, index = _importing_worker(8)
    w.import_prefix(chain)  # 12 blocks into a pool of 8: a ninth would have had to evict the first
    assert list(w.cached) == chain[7::-1]  # released tail first: the head is the LRU-newest
    assert w.cached_prefix_blocks(chain) == 8
    assert all(index.holders(h) == {w.id} for h in chain[:8])
    assert all(not index.holders(h) for h in chain[8:])

    w, index = _importing_worker(8)
    w.import_prefix(chain[:6])
    assert w._allocate(5)  # a request's 5 blocks: the 2 free and 3 of the chain's, from its end
    assert w.cached_prefix_blocks(chain) == 3
    assert all(not index.holders(h) for h in chain[3:6])


def test_an_import_after_a_local_prefix_keeps_the_whole_chain_ordered():
    chain = list(range(1000, 1010))
    w, _ = _importing_worker(9)
    w.import_prefix(chain[:3])  # the worker's own history
    w.import_prefix(chain)  # 7 more into the 6 left: the local 3 are held, so it stops at 6
    assert w.cached_prefix_blocks(chain) == 9
    assert w._allocate(5)
    assert w.cached_prefix_blocks(chain) == 4


def test_a_decode_leg_imports_its_prompt_on_arrival_and_recomputes_what_was_evicted():
    # as the engine's add_request: a decode leg's blocks sit in the prefix cache while it waits
    from tokenops.sim.engine_model import SimRequest

    w, _ = _importing_worker(12)
    r = SimRequest(0, 0.0, 100, 4, cache_hashes=range(2000, 2007))  # 6 whole blocks of 16
    w.add_decode(r)
    assert w.cached_prefix_blocks(r.cache_hashes) == 6
    assert r.queued_tokens == 100 - 96
    assert w._allocate(9)  # others take 9 blocks while it waits: 3 of its, from the end
    w.used_private -= 9  # and give them back
    w._plan(None)
    assert w._batch == [(r, 100 - 48)] and r.computed == 48


def test_a_finished_sequence_is_evicted_tail_first_as_the_engine_frees_it():
    # a 10-block prompt runs alone in a pool of 16 blocks; an unrelated one then needs 5 of its cached
    # blocks; the first prompt again finds the head the engine keeps (its last blocks went first),
    # where evicting from the head would leave nothing reachable
    shape = EngineShape(num_kv_blocks=16, max_num_batched_tokens=512, max_num_seqs=4)
    sessions = [
        _session(0, 160, 2, 0.0, shared=10),
        _session(1, 160, 2, 1.0),
        _session(2, 160, 2, 2.0, shared=10),
    ]
    fleet, res = _run(sessions, shape)
    cached = [r.cached_tokens for r in sorted(res.records, key=lambda r: r.session_id)]
    assert cached == [0, 0, 5 * 16]
    assert _engine_in_turn([_blocks(0, 10, 0), _blocks(1, 0, 10), _blocks(2, 10, 0)], shape, 2) == cached


def test_an_exact_index_follows_a_tail_first_eviction():
    from tokenops.cluster.policies import PrefixAware

    shape = EngineShape(num_kv_blocks=16, max_num_batched_tokens=512, max_num_seqs=4)
    first = _session(0, 160, 2, 0.0, shared=10)
    fleet, _ = _run([first, _session(1, 160, 2, 1.0)], shape, cfg={"exact_index": True},
                    policy=PrefixAware(learn=False))  # fmt: skip
    hashes = first.rounds[0].hashes
    w, index = fleet.workers[0], fleet.policy.index
    assert [index.holders(h) == {w.id} for h in hashes] == [True] * 5 + [False] * 5
    assert set(w.cached) >= set(hashes[:5])


def test_the_replica_preempts_the_request_added_last_as_the_engine_does():
    # a decode leg reaches its replica after requests that reached the gateway later: the replica
    # orders requests as they were added to it, so the one added last is preempted when KV runs out,
    # whatever its gateway arrival time
    from tokenops.sim.engine_model import ReplicaEngine, SimRequest
    from tokenops.sim.events import EventLoop

    shape = EngineShape(num_kv_blocks=8, max_num_batched_tokens=256, max_num_seqs=4)
    loop, done = EventLoop(), []
    w = ReplicaEngine("r0", PERF, shape, loop, done.append)
    first = SimRequest(0, 5.0, 48, 40, hashes=(1, 2, 3))  # added first, reached the gateway last
    second = SimRequest(1, 1.0, 48, 40, hashes=(4, 5, 6))
    w.add(first)
    w.add(second)
    loop.run()
    assert len(done) == 2 and w.preemptions >= 1
    assert first.epoch == 0 and second.epoch >= 1

    sched = engine_scheduler(shape)
    seqs = [engine_seq(i, [1 + 48 * i + k for k in range(48)], 40) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    step_to_end(sched)
    assert [s.num_preemptions > 0 for s in seqs] == [False, True]


def test_a_prefill_leg_holds_its_blocks_until_the_pull_lands():
    # as the engine's KV hold: the prompt's blocks stay taken (shareable, not evictable) after the
    # prefill, then are released tail first when the decode worker's pull has landed
    from tokenops.sim.engine_model import ReplicaEngine, SimRequest
    from tokenops.sim.events import EventLoop

    loop, prefilled = EventLoop(), []
    w = ReplicaEngine("p0", PERF, EngineShape(num_kv_blocks=8), loop, lambda r: None, prefilled.append)
    r = SimRequest(0, 0.0, 64, 4, hashes=(1, 2, 3, 4), cache_hashes=(1, 2, 3, 4))
    r.prefill_only = True
    w.add(r)
    loop.run()
    assert prefilled == [r]
    assert w.available_blocks() == 4 and not w.cached  # held: neither free nor evictable
    w.unpin_for_peer(r)
    assert w.available_blocks() == 8 and list(w.cached) == [4, 3, 2, 1]


def test_a_pull_of_history_pins_its_blocks_on_the_worker_it_comes_from_until_it_lands():
    # the source's KV server pins the blocks it sends: they cannot be evicted during the transfer,
    # and afterwards they are the LRU-newest, tail first
    from tokenops.sim.engine_model import SimRequest

    w, _ = _importing_worker(8)
    w.import_prefix([1, 2, 3])
    w.import_prefix([10, 11, 12])
    pull = SimRequest(0, 0.0, 48, 4)
    w.pin_for_peer(pull, [1, 2, 3])
    assert not w._allocate(6)  # 2 free and the 3 unpinned: the pinned blocks are out of reach
    assert w._allocate(5) and w.cached_prefix_blocks([1, 2, 3]) == 3
    w.used_private -= 5
    w.unpin_for_peer(pull)
    assert list(w.cached) == [3, 2, 1]
    assert w._allocate(5) and w.cached_prefix_blocks([1, 2, 3]) == 3


@pytest.mark.parametrize("seed", range(6))
def test_random_imports_pulls_and_allocations_leave_the_engines_cache(seed):
    # the engine's block pool and the replica model, put through the same random imports (a peer's
    # chain after whatever head is held here), pulls (a peer pins and unpins held blocks) and
    # allocations (a request's private blocks, taken and given back): the same blocks cached, in the
    # same LRU order, after every operation
    from tokenops.engine.block_pool import BlockPool
    from tokenops.sim.engine_model import SimRequest

    rng = random.Random(seed)
    pool_blocks = rng.randint(6, 24)
    w, _ = _importing_worker(pool_blocks)
    pool = BlockPool(pool_blocks, 16)
    chains = [block_tokens([100 * c + b for b in range(12)]) + [0] for c in range(4)]
    to_sim = {}
    for c, tokens in enumerate(chains):
        for j, h in enumerate(pool.prefix_hashes(tokens)):
            to_sim[h] = 1000 * c + j
    for _ in range(60):
        op, c = rng.choice(("import", "import", "pull", "allocate")), rng.randrange(4)
        tokens = chains[c]
        expected = pool.prefix_hashes(tokens)
        sim_chain = [to_sim[h] for h in expected]
        if op == "import":
            end = rng.randint(1, 12)
            have = pool.cached_blocks(expected)
            pool.import_chain(tokens, have, expected[have:end])
            w.import_prefix(sim_chain[: max(end, have)])
        elif op == "pull":
            end = rng.randint(1, 12)
            pool.unpin(pool.pin_cached(expected[:end]))
            pull = SimRequest(0, 0.0, 16, 1)
            w.pin_for_peer(pull, sim_chain[:end])
            w.unpin_for_peer(pull)
        else:
            n = rng.randint(1, pool_blocks)
            seq = engine_seq(0, list(range(16 * n)), 1)
            pool.allocate(seq, 16 * n)
            pool.free(seq)  # nothing indexed: the blocks go back as plain free ones
            assert w._allocate(n)
            w.used_private -= n
        engine_lru = [to_sim[pool.blocks[b].block_hash] for b in pool._free_cached]
        assert engine_lru == list(w.cached), (op, c)
        pool.check_invariants()


def test_a_live_engines_load_report_gives_the_shape_it_runs():
    # /v1/load's pool, block size and step limits (as the engine resolved them on its CPU) override
    # the candidate's; what a report lacks (another server) keeps the candidate's, else the defaults
    report = {
        "kv_blocks_total": 3773, "block_size": 32,
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_chunk_tokens": None,
                      "max_prefill_step_tokens": 1024},
    }  # fmt: skip
    like = EngineShape(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=100, max_chunk_tokens=64)
    shape = EngineShape.of_engine(report, like)
    assert shape == EngineShape(max_num_seqs=32, max_num_batched_tokens=512, block_size=32,
                                num_kv_blocks=3773, max_chunk_tokens=None,
                                max_prefill_step_tokens=1024)  # fmt: skip
    assert EngineShape.of_engine({"kv_blocks_total": 50}, like) == EngineShape(
        max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=50, max_chunk_tokens=64
    )
    assert EngineShape.of_engine({}) == EngineShape()
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineShape.of_engine({"scheduler": {"max_num_seqs": 600}})
