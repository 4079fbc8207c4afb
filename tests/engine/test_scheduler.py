"""The scheduler without a model: batches, budgets, chunked prefill, priorities, preemption, rejection.

Each test drives `Scheduler.schedule()` / `update()` with plain `Sequence` objects and feeds back a
fixed token whenever a sequence is due to sample, as the engine would after running the model.
"""

from __future__ import annotations

import pytest

from tokenops.engine.block_pool import BlockPool
from tokenops.engine.config import ContextLengthExceeded, EngineConfig
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.scheduler import Scheduler, SchedulerOutput
from tokenops.engine.sequence import Sequence, SequenceStatus


def make(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=32,
    max_model_len=1024,
    eos=(0,),
    chunk=None,
    prefill_step=None,
):
    """A scheduler on a small pool; `prefill_step`: its max_prefill_step_tokens (default the budget, so
    every step keeps the one budget)."""
    cfg = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_chunk_tokens=chunk,
        max_prefill_step_tokens=prefill_step or budget,
    )
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(cfg, pool, max_model_len, eos)


def seq(rid, n, max_tokens=4, priority=0, start=1):
    return Sequence(
        rid,
        list(range(start, start + n)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=False),
        priority=priority,
    )


def step(s: Scheduler, token=7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [token if e.samples else None for e in out.scheduled])
    return out


def run_to_end(s: Scheduler, limit=500) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def test_batches_decodes_and_finishes_by_length():
    s = make()
    a, b = seq("a", 5, max_tokens=3), seq("b", 3, max_tokens=2)
    s.add(a)
    s.add(b)
    out = step(s)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 5), ("b", 3)]
    out = step(s)
    assert [e.num_new_tokens for e in out.scheduled] == [1, 1]
    assert b.is_finished and b.finish_reason == "length" and b.output_token_ids == [7, 7]
    run_to_end(s)
    assert a.output_token_ids == [7, 7, 7]
    assert s.pool.num_free_blocks == s.pool.num_blocks
    s.pool.check_invariants()


def test_stop_on_eos_and_stop_token_unless_ignore_eos():
    s = make(eos=(7,))
    a = seq("a", 3, max_tokens=5)
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    c = Sequence("c", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True))
    for x in (a, b, c):
        s.add(x)
    step(s, token=7)
    assert a.finish_reason == "stop" and a.output_token_ids == [7]
    assert not b.is_finished and not c.is_finished
    step(s, token=9)
    assert c.finish_reason == "stop"
    run_to_end(s)
    assert b.finish_reason == "length" and len(b.output_token_ids) == 3


def test_decodes_first_then_chunked_prefill_fills_budget():
    s = make(budget=8)
    a = seq("a", 4, max_tokens=10)
    s.add(a)
    step(s)  # a's prefill
    long = seq("long", 30, max_tokens=2, start=100)
    s.add(long)
    chunks = []
    while not long.output_token_ids:
        out = step(s)
        kinds = [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled]
        assert kinds[0] == ("a", 1), "the running decode must be in every step"
        assert out.num_batched_tokens <= 8
        chunks.append(kinds[1][1])
    assert chunks == [7, 7, 7, 7, 2]  # the long prompt is spread over steps, never stalling a


def test_chunk_cap_admits_several_prompts_per_step_and_still_chunks_a_long_one():
    s = make(budget=32, chunk=8)
    a = seq("a", 4, max_tokens=10)
    s.add(a)
    step(s)  # a's prefill
    long, p1, p2 = seq("long", 20, max_tokens=2, start=100), seq("p1", 6, start=200), seq("p2", 8, start=300)
    for x in (long, p1, p2):
        s.add(x)
    out = step(s)
    # the decode, then each waiting prompt up to the cap: three admitted in one step, none over 8
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [
        ("a", 1),
        ("long", 8),
        ("p1", 6),
        ("p2", 8),
    ]
    out = step(s)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled if e.seq is long] == [("long", 8)]
    # without the cap the same budget lets the long prompt take it whole and p2 wait a step
    s = make(budget=32)
    s.add(a2 := seq("a", 4, max_tokens=10))
    step(s)
    for x in (seq("long", 20, start=100), seq("p1", 6, start=200), seq("p2", 8, start=300)):
        s.add(x)
    out = step(s)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [
        ("a", 1),
        ("long", 20),
        ("p1", 6),
        ("p2", 5),
    ]
    assert a2.num_computed_tokens == 5


def test_chunk_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        EngineConfig(max_chunk_tokens=0)


def test_waiting_queue_ordered_by_priority_then_arrival():
    s = make(max_num_seqs=1)
    low, high1, high2 = seq("low", 2, priority=5), seq("high1", 2, priority=0), seq("high2", 2, priority=0)
    for x in (low, high1, high2):
        s.add(x)
    order = []
    while s.has_unfinished():
        out = step(s)
        for e in out.scheduled:
            if e.seq.request_id not in order:
                order.append(e.seq.request_id)
    assert order == ["high1", "high2", "low"]


def test_max_num_seqs_limits_the_batch():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(seq(str(i), 2))
    out = step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 2


def test_preempts_lowest_priority_latest_and_recovers():
    # 6 blocks of 4 tokens; three sequences of 8 tokens that each grow to 16: they cannot all fit
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b, c = (
        seq("a", 8, max_tokens=8, priority=1),
        seq("b", 8, max_tokens=8, priority=0),
        seq("c", 8, max_tokens=8, priority=1),
    )
    for x in (a, b, c):
        s.add(x)
    outs = run_to_end(s)
    preempted = [p.request_id for o in outs for p in o.preempted]
    assert preempted and preempted[0] == "c"  # priority 1 and latest
    assert "b" not in preempted  # the most important one is never the victim here
    for x in (a, b, c):
        assert x.finish_reason == "length" and len(x.output_token_ids) == 8
    assert s.pool.num_free_blocks == 6
    assert all(blk.ref_count == 0 for blk in s.pool.blocks)
    s.pool.check_invariants()


def test_preempted_sequence_recomputes_its_generated_tokens():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 6, max_tokens=6, start=1), seq("b", 6, max_tokens=6, start=50)
    s.add(a)
    s.add(b)
    saw_recompute = False
    while s.has_unfinished():
        out = s.schedule()
        for e in out.scheduled:
            if e.seq.num_preemptions and e.seq.num_output_tokens and e.num_new_tokens > 1:
                saw_recompute = True  # prompt + outputs so far are prefilled again
        s.update(out, [7 if e.samples else None for e in out.scheduled])
    assert saw_recompute
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6


def test_single_sequence_as_large_as_the_pool_never_crashes():
    s = make(num_blocks=4, block_size=4, budget=5, max_model_len=10_000)
    assert s.max_model_len == 16  # capped by the pool
    a = seq("a", 12, max_tokens=100)
    s.add(a)
    run_to_end(s)
    assert a.finish_reason == "length" and len(a.token_ids) == 16


def test_rejects_requests_that_can_never_fit():
    s = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ContextLengthExceeded) as err:
        s.add(seq("big", 16))
    assert err.value.limit == 16 and err.value.code == "context_length_exceeded"
    s2 = make(max_model_len=10)
    with pytest.raises(ContextLengthExceeded):
        s2.add(seq("x", 10))
    s2.add(seq("ok", 9))


def test_abort_frees_blocks_waiting_and_running():
    s = make(max_num_seqs=1)
    a, b = seq("a", 9, max_tokens=50), seq("b", 9, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    assert s.pool.num_used_blocks == 3
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert s.pool.num_used_blocks == 0 and not s.has_unfinished()
    assert b.status is SequenceStatus.FINISHED and s.schedule().is_empty


def test_prefix_cache_reused_across_requests_and_reported():
    s = make(block_size=4)
    a = seq("a", 10, max_tokens=1)
    s.add(a)
    run_to_end(s)
    b = seq("b", 10, max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8 and out.scheduled[0].num_new_tokens == 2


def test_prefix_queries_counted_once_per_request():
    # b cannot be admitted while a holds most of the pool; retries must not inflate the counters
    s = make(num_blocks=5, block_size=4, budget=64)
    a, b = seq("a", 15, max_tokens=3), seq("b", 9, max_tokens=2, start=100)
    s.add(a)
    s.add(b)
    outs = run_to_end(s)
    assert len(outs) > 3 and s.pool.prefix_queries == 15 + 9
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0


def test_identical_prompts_prefill_once_the_siblings_reuse_the_blocks():
    # the n choices of one request: the first prefills, the others wait a step and hit the prefix cache
    s = make(block_size=4, budget=64)
    choices = [seq(f"r-{i}", 10, max_tokens=2) for i in range(3)]
    for c in choices:
        s.add(c)
    first = s.schedule()
    assert [(e.seq.request_id, e.num_new_tokens) for e in first.scheduled] == [("r-0", 10)]
    s.update(first, [7 if e.samples else None for e in first.scheduled])
    second = s.schedule()
    assert [(e.seq.request_id, e.num_new_tokens) for e in second.scheduled] == [
        ("r-0", 1), ("r-1", 2), ("r-2", 2),
    ]  # fmt: skip
    assert [c.num_cached_tokens for c in choices] == [0, 8, 8]
    s.update(second, [7 if e.samples else None for e in second.scheduled])
    run_to_end(s)
    # different prompts are not held back
    t = make(block_size=4, budget=64)
    t.add(seq("a", 10, max_tokens=1))
    t.add(seq("b", 10, max_tokens=1, start=50))
    assert len(t.schedule().scheduled) == 2


def shared(rid, head, tail, max_tokens=2):
    return Sequence(rid, head + tail, SamplingParams(max_tokens=max_tokens, ignore_eos=False))


def test_a_common_system_prompt_holds_back_one_step_then_every_request_is_admitted():
    # 6 requests: a shared head of 10 tokens (2 full blocks of 4, then half a block), distinct tails
    s = make(block_size=4, budget=64)
    head = list(range(100, 110))
    reqs = [shared(f"r-{i}", head, [200 + i] * 6) for i in range(6)]
    for r in reqs:
        s.add(r)
    first = step(s)
    assert [e.seq.request_id for e in first.scheduled] == ["r-0"]  # the others would recompute its head
    second = step(s)
    # the head's full blocks are cached now: every other request is admitted in this one step, though
    # they all still share their first block
    assert [e.seq.request_id for e in second.scheduled] == [f"r-{i}" for i in range(6)]
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 8, 8, 8, 8]
    run_to_end(s)


def test_a_request_waits_while_the_head_it_shares_is_prefilled_in_chunks():
    # r-a's 40-token prompt prefills in chunks of 16; r-b shares its first 24 tokens
    s = make(block_size=4, budget=16)
    head = list(range(100, 124))
    a, b = shared("r-a", head, [300] * 16), shared("r-b", head, [400] * 8)
    s.add(a)
    s.add(b)
    assert [e.seq.request_id for e in step(s).scheduled] == ["r-a"]  # blocks 0-3 of the head
    assert [e.seq.request_id for e in step(s).scheduled] == ["r-a"]  # r-b's next block 4 is r-a's now
    third = step(s)  # the head is cached: r-b computes only its own 8 tokens
    assert [(e.seq.request_id, e.num_new_tokens) for e in third.scheduled] == [("r-a", 8), ("r-b", 8)]
    assert b.num_cached_tokens == 24
    run_to_end(s)


def test_a_step_without_decodes_lets_its_first_prefill_take_the_prefill_step_budget():
    """No decode running: the first prefill runs to max_prefill_step_tokens (a 50-token prompt in one
    chunk, not two of 32); with a decode running, the 32-token budget holds; a prompt shorter than the
    budget leaves the budget as it is, for the requests behind it; max_chunk_tokens caps the chunk."""
    s = make(budget=32, prefill_step=64)
    long_one = seq("long", 50, max_tokens=3)
    s.add(long_one)
    out = step(s)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("long", 50)]
    assert out.num_batched_tokens == 50
    s.add(seq("next", 50, max_tokens=1, start=2))
    out = step(s)  # "long" decodes now: the budget is 32 again, 31 left for the prompt
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("long", 1), ("next", 31)]
    run_to_end(s)
    s = make(budget=32, prefill_step=64)
    for i in range(3):
        s.add(seq(f"short-{i}", 20, start=1 + i))
    out = step(s)  # the first needs 20 of the 32: the others share what is left, as before
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("short-0", 20), ("short-1", 12)]
    s = make(budget=32, prefill_step=64, chunk=40)
    s.add(seq("capped", 50))
    assert [(e.seq.request_id, e.num_new_tokens) for e in step(s).scheduled] == [("capped", 40)]
    with pytest.raises(ValueError, match="max_prefill_step_tokens"):
        EngineConfig(max_prefill_step_tokens=0)


def test_the_prefill_step_budget_defaults_on_only_where_the_cpu_has_amx(monkeypatch):
    from tokenops.engine import config as config_module

    for feature_set, expect in (
        ("amx", config_module.PREFILL_STEP_TOKENS_AMX),
        ("avx2", 512),
        ("avx512_bf16", 512),
    ):
        monkeypatch.setattr(config_module, "has_bf16_tiles", lambda device, fs=feature_set: fs == "amx")
        assert EngineConfig().max_prefill_step_tokens == expect, feature_set
        assert EngineConfig(max_num_batched_tokens=2048).max_prefill_step_tokens == (
            1024 if feature_set == "amx" else 2048
        )
    assert EngineConfig(max_prefill_step_tokens=300).max_prefill_step_tokens == 300
    monkeypatch.setattr(config_module, "has_bf16_tiles", lambda device: True)
    evicting = EngineConfig(kv_eviction={"sink_tokens": 4, "window_tokens": 64})
    assert evicting.max_prefill_step_tokens == 512  # its pool is sized for one step of the budget


def test_without_prefix_caching_no_request_is_held_back():
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(cfg, BlockPool(64, 4, enable_prefix_caching=False), 1024, (0,))
    for i in range(3):
        s.add(shared(f"r-{i}", list(range(100, 110)), [200 + i]))
    assert len(s.schedule().scheduled) == 3


def test_a_request_waiting_for_a_shared_head_keeps_its_place_and_lets_the_others_go_ahead():
    s = make(block_size=4, budget=20, chunk=16)
    head = list(range(100, 124))
    a, b = shared("r-a", head, [300] * 16), shared("r-b", head, [400] * 8)
    c = seq("r-c", 4, max_tokens=1, start=900)  # arrived after r-b and shares nothing
    for x in (a, b, c):
        s.add(x)
    ran = [[(e.seq.request_id, e.num_new_tokens) for e in step(s).scheduled] for _ in range(3)]
    assert ran == [
        [("r-a", 16), ("r-c", 4)],  # r-b waits for the head r-a computes; r-c does not wait behind it
        [("r-a", 16)],  # r-b's next block is r-a's again
        [("r-a", 8), ("r-b", 8)],  # the head is cached: r-b computes its own 8 tokens
    ]
    assert b.num_cached_tokens == 24 and c.status is SequenceStatus.FINISHED


def test_a_request_set_aside_lets_only_requests_of_its_priority_go_ahead():
    s = make(block_size=4, budget=20, chunk=16)
    head = list(range(100, 124))
    a = shared("r-a", head, [300] * 16)
    b = Sequence("r-b", head + [400] * 8, SamplingParams(max_tokens=2, ignore_eos=False), priority=0)
    low = seq("r-low", 4, max_tokens=1, priority=5, start=900)
    a.priority = -1
    for x in (a, b, low):
        s.add(x)
    # r-b waits for r-a's head; r-low, of a lower priority, stays behind it rather than taking its turn
    assert [e.seq.request_id for e in step(s).scheduled] == ["r-a"]
