"""KV eviction (attention sinks + recent window): attention over a sequence with a gap equals dense
attention over the kept keys at their absolute positions; in the engine the block table stays
bounded while a sequence generates far past the pool, the sinks and the recent window are what
remain, a sequence under the budget is unaffected, the prefix cache never indexes post-eviction
blocks, and preemption under eviction finishes every request with a consistent pool.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.attention import paged_attention
from tokenops.engine.config import EngineConfig, KVEvictionConfig
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.sampling_params import SamplingParams

H, KV, D = 4, 2, 8
BS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("new", "window"), [(1, None), (6, None), (1, 7), (5, 9)])
def test_attention_with_a_gap_equals_dense_attention_over_the_kept_keys(new, window):
    """Sequence of 30 cached tokens; blocks 1..4 (tokens 4..19) are evicted; `new` tokens attend.
    A second, unevicted sequence decodes in the same batch."""
    g = torch.Generator().manual_seed(new)
    caches = allocate_kv_caches(1, 32, BS, KV, D, torch.float32)
    total = 30 + new
    q, k, v = (torch.randn(total, h, D, generator=g) for h in (H, KV, KV))
    table = list(range(10, 10 + -(-total // BS)))
    paged_attention(q[:30], k[:30], v[:30], build_context([30], [30], [table], BS, caches), 0, 0.3, window)
    kept_table = table[:1] + table[5:]  # drop logical blocks 1..4
    other_q, other_k, other_v = (torch.randn(6, h, D, generator=g) for h in (H, KV, KV))
    paged_attention(
        other_q[:5], other_k[:5], other_v[:5], build_context([5], [5], [[0, 1]], BS, caches), 0, 0.3
    )
    ctx = build_context([new, 1], [total, 6], [kept_table, [0, 1]], BS, caches, kv_gaps=[(4, 16), (0, 0)])
    out = paged_attention(
        torch.cat([q[30:], other_q[5:]]),
        torch.cat([k[30:], other_k[5:]]),
        torch.cat([v[30:], other_v[5:]]),
        ctx,
        0,
        0.3,
        window,
    )
    kept = torch.cat([torch.arange(0, 4), torch.arange(20, total)])  # absolute positions kept
    qpos = torch.arange(30, total)
    mask = kept[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kept[None, :] > qpos[:, None] - window
    kk, vv = (t[kept].repeat_interleave(H // KV, dim=1).transpose(0, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[30:].transpose(0, 1), kk, vv, attn_mask=mask, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(out[:new], ref, atol=1e-5, rtol=1e-5)


def engine(model, eviction: KVEvictionConfig | None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLMEngine(model, EngineConfig(block_size=BS, kv_eviction=eviction, **kw), eos_token_ids=[2])


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


SINK_WINDOW = KVEvictionConfig(sink_tokens=4, window_tokens=16)


def test_block_table_stays_bounded_far_past_the_pool_and_keeps_sinks_and_window(tiny_llama):
    e = engine(tiny_llama.model, SINK_WINDOW, num_kv_blocks=14)  # 56 slots; the sequence reaches 250 tokens
    bound = e.scheduler.eviction.max_blocks_per_sequence(16)
    e.add_request("long", prompts(10)[0], SamplingParams(max_tokens=240, temperature=0, ignore_eos=True))
    seq = e._requests["long"]
    produced, most = 0, 0
    while e.has_unfinished():
        for o in e.step():
            produced += len(o.new_token_ids)
        if not seq.is_finished:
            most = max(most, len(seq.block_table))
            computed = seq.num_computed_tokens
            if computed > 4 + 16 + BS + 1:
                # what remains: the sink block [0, 4) and at least the 16 tokens before the last query
                # (at position computed - 1), whole blocks, so less than one block more
                assert seq.kv_gap_start == 4
                kept_from = seq.kv_gap_start + seq.kv_gap_len
                assert computed - 1 - 16 - BS < kept_from <= computed - 1 - 16
                assert len(seq.block_table) == 1 + -(-(computed - kept_from) // BS)
    assert produced == 240
    assert most <= bound <= 14
    assert e.load().kv_evicted_blocks >= (250 - 4 - 16 - BS) // BS
    assert e.pool.num_free_blocks == e.pool.num_blocks
    e.pool.check_invariants()


def test_sequence_under_the_budget_is_unaffected(tiny_llama):
    ps = prompts(5, 8, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # <= 20 tokens: sinks + window
    full = engine(tiny_llama.model, None).generate(ps, params)
    evicting = engine(tiny_llama.model, SINK_WINDOW)
    assert evicting.generate(ps, params) == full
    assert evicting.load().kv_evicted_blocks == 0


def test_output_equals_full_kv_until_the_first_eviction(tiny_llama):
    ps = prompts(6, 11, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = engine(tiny_llama.model, None).generate(ps, params)
    evicted = engine(tiny_llama.model, SINK_WINDOW).generate(ps, params)
    for p, a, b in zip(ps, full, evicted, strict=True):
        # the first eviction happens once 16 + 2 blocks' worth are computed: tokens before it match
        n = 4 + 16 + BS - len(p)
        assert a[:n] == b[:n]


def test_prefix_cache_indexes_only_blocks_computed_before_eviction(tiny_llama):
    e = engine(tiny_llama.model, SINK_WINDOW)
    p = prompts(12, seed=3)[0]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    first = e.generate([p], params)[0]
    # blocks indexed: those full before the first eviction, at most 4 + 16 + BS tokens' worth
    assert 0 < e.pool.lookup(p + first) <= 4 + 16 + BS
    again = e.generate([p], params)[0]
    assert e.pool.prefix_hits >= 8
    assert again == first  # the hit reuses exact (pre-eviction) blocks; evictions happen at the same points
    e.pool.check_invariants()


def test_preemption_under_eviction_finishes_everything_consistently(tiny_llama):
    ps = prompts(9, 14, 7, seed=4)
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    roomy = engine(tiny_llama.model, SINK_WINDOW).generate(ps, params)
    tight = engine(tiny_llama.model, SINK_WINDOW, num_kv_blocks=16)
    outs = tight.generate(ps, params)
    assert tight.stats.preemptions > 0
    assert [len(o) for o in outs] == [80] * 3
    assert tight.pool.num_free_blocks == tight.pool.num_blocks
    tight.pool.check_invariants()
    # identical up to the first eviction; after a preemption the recomputed KV saw a different
    # eviction history (chunks, not single tokens), so later tokens may differ
    for p, a, b in zip(ps, roomy, outs, strict=True):
        n = 4 + 16 + BS - len(p)
        assert a[:n] == b[:n]


def test_pool_too_small_for_the_window_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_eviction needs at least"):
        engine(tiny_llama.model, KVEvictionConfig(sink_tokens=4, window_tokens=64), num_kv_blocks=10)
    with pytest.raises(ValueError, match="unknown kv_eviction keys"):
        EngineConfig(kv_eviction={"window": 5})


def test_gemma3_sliding_window_layers_under_eviction(tiny_gemma3):
    """Gemma 3's 5-token sliding window inside the kept window: unchanged under the budget, and a long
    run through a small pool finishes with the pool drained."""
    ps = prompts(6, 9, seed=5)
    short = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert engine(tiny_gemma3.model, SINK_WINDOW).generate(ps, short) == engine(
        tiny_gemma3.model, None
    ).generate(ps, short)
    e = engine(tiny_gemma3.model, SINK_WINDOW, num_kv_blocks=14)
    outs = e.generate(ps, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    assert [len(o) for o in outs] == [120, 120]
    assert e.load().kv_evicted_blocks > 0
    assert e.pool.num_free_blocks == e.pool.num_blocks
