"""int8 KV cache: the quantiser's error bound, paged attention over int8 KV against float32 attention,
the engine's block count for a memory budget, and greedy output with int8 KV (tiny Llama: identical
under chunking, prefix hits and preemption; agreement with float32 measured; bundled SmolLM2: the
first tokens identical to float32's on a few prompts).
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.attention import paged_attention
from tokenops.engine.config import EngineConfig
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import (
    QuantizedKV,
    allocate_kv_caches,
    kv_bytes_per_block,
    kv_bytes_per_token,
    quantize,
)
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.sampling_params import SamplingParams

H, KV, D = 4, 2, 16
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def dequant(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize(x)
    return q.float() * s.float()


def test_round_trip_error_is_within_half_a_step_per_token_and_head():
    x = torch.randn(64, KV, D) * torch.rand(64, KV, 1) * 10  # scales differ per token and head
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (64, KV, 1)
    err = (dequant(x) - x).abs()
    assert bool((err <= scale.float() / 2 + 1e-6).all())
    # the largest value of each (token, head) is represented exactly up to float16 rounding of its scale
    assert float((err.amax(-1) / x.abs().amax(-1)).max()) < 1 / 254 + 1e-3


def dense(q, k, v, scale):
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    k, v = (t.repeat_interleave(H // KV, dim=1).transpose(0, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=scale
    ).transpose(0, 1)


def run_int8(cached: list[int], new: list[int], block_size: int = 4, seed: int = 0):
    """Write `cached` tokens per sequence, then attend `new` ones; return (out, per-seq q/k/v, rows)."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(1, 64, block_size, KV, D, torch.int8)
    assert isinstance(caches[0][0], QuantizedKV)
    free = torch.randperm(64, generator=g).tolist()
    tables, full = [], []
    for c, n in zip(cached, new, strict=True):
        tables.append([free.pop() for _ in range(-(-(c + n) // block_size))])
        full.append(tuple(torch.randn(c + n, h, D, generator=g) for h in (H, KV, KV)))
    for s, c in enumerate(cached):
        if c:
            q, k, v = full[s]
            paged_attention(
                q[:c], k[:c], v[:c], build_context([c], [c], [tables[s]], block_size, caches), 0, 0.25
            )
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    ctx = build_context(list(new), lens, tables, block_size, caches)
    parts = [torch.cat([f[i][c:] for f, c in zip(full, cached, strict=True)]) for i in range(3)]
    return paged_attention(*parts, ctx, 0, 0.25), full


def test_int8_attention_equals_attention_over_the_dequantised_keys_and_values():
    cached, new = [5, 0, 17, 8], [1, 9, 1, 6]
    out, full = run_int8(cached, new)
    row = 0
    for (q, k, v), c, n in zip(full, cached, new, strict=True):
        ref = dense(q[c:], dequant(k), dequant(v), 0.25)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
        row += n


def test_int8_attention_close_to_float32_attention():
    """Bound: each cached value is off by at most max|x| / 254 of its (token, head), about 0.012 for
    unit normals over 16 dims (max ~3); a value error moves the output by at most that much (the
    weights sum to 1), a key error moves a logit by at most 0.25 * sum|q| * 0.012 ~ 0.04, a weight by
    ~4% of itself. So atol 0.05 for the worst element; the mean error is asserted 10x tighter."""
    cached, new = [5, 0, 17, 8, 30], [1, 9, 1, 6, 1]
    out, full = run_int8(cached, new, seed=1)
    refs = torch.cat([dense(q[c:], k, v, 0.25) for (q, k, v), c in zip(full, cached, strict=True)])
    err = (out - refs).abs()
    assert float(err.max()) < 0.05
    assert float(err.mean()) < 0.005


def test_block_count_grows_with_int8_for_the_same_budget(tiny_llama):
    c = tiny_llama.config  # head_dim 16: int8 takes 16 + 2 (fp16 scale) bytes per head vs 64 (fp32)
    assert kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.int8) == 2 * 2 * 2 * 18
    budget = 1 << 20
    fp32 = LLMEngine(tiny_llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=budget))
    int8 = LLMEngine(
        tiny_llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    )
    bf16 = kv_bytes_per_block(c, 4, torch.bfloat16)
    assert int8.pool.num_blocks == budget // kv_bytes_per_block(c, 4, torch.int8)
    assert int8.pool.num_blocks / fp32.pool.num_blocks == pytest.approx(64 / 18, rel=0.01)
    assert budget // bf16 * 1.7 < int8.pool.num_blocks  # ~1.8x bf16's count (head_dim 16; 1.94x at 64)
    load = int8.load().to_dict()
    assert load["kv_cache_dtype"] == "int8" and load["kv_bytes_per_token"] == 144
    assert load["kv_blocks_total"] == int8.pool.num_blocks


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def engine(model, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_dtype", "int8")
    return LLMEngine(model, EngineConfig(**kw), eos_token_ids=[2])


def test_int8_kv_output_does_not_depend_on_chunking_prefix_hits_or_preemption(tiny_llama):
    ps = prompts(9, 14, 7, 11, seed=3)
    ref = engine(tiny_llama.model).generate(ps, GREEDY)
    assert engine(tiny_llama.model, max_num_batched_tokens=5).generate(ps, GREEDY) == ref
    cached = engine(tiny_llama.model)
    cached.generate(ps, GREEDY)
    again = cached.generate(ps, GREEDY)  # every full prompt block comes from the prefix cache
    assert cached.pool.prefix_hits > 0
    assert again == ref
    tight = engine(tiny_llama.model, num_kv_blocks=14)
    assert tight.generate(ps, GREEDY) == ref
    assert tight.stats.preemptions > 0


def test_int8_kv_greedy_agreement_with_float32_on_a_tiny_model(tiny_llama):
    """A random tiny model has small logit margins, so int8 KV may flip a close call; after the first
    difference the two continuations diverge. Measured: the first 8 tokens agree on every prompt."""
    ps = prompts(9, 14, 7, 11, 20, seed=4)
    fp = engine(tiny_llama.model, kv_cache_dtype="auto").generate(ps, GREEDY)
    q = engine(tiny_llama.model).generate(ps, GREEDY)
    assert [o[:8] for o in q] == [o[:8] for o in fp]
    same = sum(a == b for x, y in zip(q, fp, strict=True) for a, b in zip(x, y, strict=True))
    assert same / sum(map(len, fp)) >= 0.8


@pytest.mark.bundled
def test_smollm2_int8_kv_first_tokens_equal_float32(bundled_model):
    loaded = bundled_model("smollm2-135m-instruct")
    tok = loaded.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ]
    ps = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in questions
    ]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    fp = LLMEngine(loaded.model, EngineConfig(num_kv_blocks=64)).generate(ps, params)
    q = LLMEngine(loaded.model, EngineConfig(num_kv_blocks=64, kv_cache_dtype="int8")).generate(ps, params)
    assert q == fp


def test_gemma3_sliding_window_layers_with_int8_kv(tiny_gemma3):
    """Sliding-window and global layers over an int8 cache: chunking changes nothing, and the first
    tokens agree with float32 KV."""
    ps = prompts(20, 7, seed=13)
    ref = engine(tiny_gemma3.model).generate(ps, GREEDY)
    assert engine(tiny_gemma3.model, max_num_batched_tokens=3).generate(ps, GREEDY) == ref
    fp = engine(tiny_gemma3.model, kv_cache_dtype="auto").generate(ps, GREEDY)
    assert [o[:8] for o in ref] == [o[:8] for o in fp]
