"""bfloat16 / float16 KV cache (`kv_cache_dtype="bfloat16"` / `"float16"`) under a float32 model:
paged attention over it equals float32-KV attention over the same rounded keys and values (decode
rows, first chunks, chunks on a cached prefix, a first chunk long enough for SDPA; kernels on and
off); the engine's greedy output with it (tiny Llama and Gemma 3: equal to float32 KV, and
unchanged by chunking, prefix hits and preemption); validation; memory accounting; what "auto" picks
(bfloat16 for bf16 / int8_dynamic weights on CPUs with native bf16).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenops.engine import attention, kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.config import EngineConfig
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import (
    allocate_kv_caches,
    kv_bytes_per_block,
    kv_bytes_per_token,
    resolve_kv_dtype,
)
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.quantize import dynamic_int8_unavailable
from tokenops.engine.quantize.common import block_kernels, has_bf16_tiles, has_native_bf16
from tokenops.engine.sampling_params import SamplingParams

from .conftest import BF16_DOT_MIN_QUERIES

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def attend(seqs, kv_dtype, k, v, q, cached_k, cached_v, tables, block_size):
    """One step of `seqs` = [(length after the step, new tokens)] over a cache of `kv_dtype` whose
    prefixes hold `cached_k` / `cached_v` (float32 [num_blocks, bs, KV, D], stored rounded)."""
    caches = allocate_kv_caches(
        1, cached_k.shape[0], block_size, cached_k.shape[2], cached_k.shape[3], kv_dtype
    )
    caches[0][0].copy_(cached_k)
    caches[0][1].copy_(cached_v)
    ctx = build_context([n for _, n in seqs], [n for n, _ in seqs], tables, block_size, caches)
    out = paged_attention(q, k, v, ctx, 0, q.shape[-1] ** -0.5)
    return out, ctx.attn_plan


SEQS = [
    [(1, 1), (37, 1), (90, 1), (5, 1)],  # decode rows only
    [(40, 40)],  # a first chunk (the kernel reads it back from the cache; SDPA with kernels off)
    [(300, 24)],  # a chunk on a cached prefix
    [(5, 1), (70, 33), (1, 1), (200, 17), (16, 16)],  # decodes and chunks mixed
    [
        (attention.NATIVE_FIRST_CHUNK_MAX + 20, attention.NATIVE_FIRST_CHUNK_MAX + 20),
        (50, 1),
    ],  # SDPA's own keys
]


@pytest.mark.parametrize("kv_dtype", HALF)
@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("seqs", SEQS)
def test_half_kv_equals_float32_kv_on_the_rounded_values(native, monkeypatch, kv_dtype, kernels_on, seqs):
    """The same float32 queries; new keys/values unrounded into the half cache, pre-rounded into the
    float32 one: both paths then attend to identical numbers, in float32 (long chunks' bf16 SDPA off;
    the kernel's bf16 dot path, where the build has it, within bf16 rounding)."""
    monkeypatch.setattr(kernels, "enabled", kernels_on)
    monkeypatch.setattr(attention, "BF16_SDPA_MIN_QUERIES", 1 << 30)
    monkeypatch.setattr(attention, "BF16_SDPA_MIN_QUERIES_CACHED", 1 << 30)
    g = torch.Generator().manual_seed(len(seqs))
    bs, heads, kvh, d = 16, 9, 3, 64
    num_blocks = sum(-(-n // bs) for n, _ in seqs) + 4
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n, _ in seqs]
    t = sum(n for _, n in seqs)
    q = torch.randn(t, heads, d, generator=g) * 2
    k, v = torch.randn(t, kvh, d, generator=g), torch.randn(t, kvh, d, generator=g)
    cached = [torch.randn(num_blocks, bs, kvh, d, generator=g).to(kv_dtype).float() for _ in range(2)]
    rounded = [x.to(kv_dtype).float() for x in (k, v)]
    got, plan = attend(seqs, kv_dtype, k, v, q, *cached, tables, bs)
    ref, _ = attend(seqs, torch.float32, *rounded, q, *cached, tables, bs)
    assert (plan.native is not None) == kernels_on
    assert got.dtype == torch.float32
    # the kernel widens a half row exactly and runs the float32 row's arithmetic on it; SDPA reads
    # widened copies too (its blocking may differ with the tensors' strides). A half cache's prefill
    # chunks run in tiles of fewer tokens, whose keys the threads may split into other chunks (merged
    # in another order): equal to float32 rounding there, bitwise for decode rows. AVX2 builds tile a
    # float32 cache's prefill chunks as small (attend_few_rows): bitwise for every kernel row there
    starts = [0, *itertools.accumulate(n for _, n in seqs)]
    sdpa = {p.rows.start for p in plan.prefills}
    dot = kv_dtype == torch.bfloat16 and kernels_on and native.prefill_bf16_dot()
    for i, (_, n) in enumerate(seqs):
        rows = slice(starts[i], starts[i] + n)
        if dot and n >= BF16_DOT_MIN_QUERIES and starts[i] not in sdpa:  # queries and weights in bf16
            torch.testing.assert_close(got[rows], ref[rows], atol=2e-2, rtol=2e-2)
        else:
            torch.testing.assert_close(got[rows], ref[rows], atol=1e-6, rtol=1e-6)
    if kernels_on and not plan.prefills:
        decodes = [starts[i] for i, (_, n) in enumerate(seqs) if n == 1]
        assert torch.equal(got[decodes], ref[decodes])
    if kernels_on and native.compiled_isa() == "avx2":
        kernel_rows = [
            r
            for i, (_, n) in enumerate(seqs)
            if starts[i] not in sdpa
            for r in range(starts[i], starts[i] + n)
        ]
        assert torch.equal(got[kernel_rows], ref[kernel_rows])


@pytest.mark.parametrize("kernels_on", [True, False])
def test_long_chunks_on_a_bf16_cache_attend_in_bf16_where_the_cpu_has_native_bf16(
    native, monkeypatch, kernels_on
):
    """Where the kernel's bf16 dot path runs on AMX's tiles, every chunk attends natively, the long
    ones in bf16 dot products; else, on a CPU with AMX, chunks of at least BF16_SDPA_MIN_QUERIES
    queries (a first chunk and one on a cached prefix), and of at least BF16_SDPA_MIN_QUERIES_CACHED on
    a cached prefix, go to SDPA in bf16, close to float32 attention on the rounded keys by bf16's
    rounding of queries and weights; without AMX the kernel's bf16 dot path, where the build has it,
    rounds them alike; a short chunk and decodes stay exact (native kernel or float32 SDPA)."""
    monkeypatch.setattr(kernels, "enabled", kernels_on)
    n, m = attention.BF16_SDPA_MIN_QUERIES, attention.BF16_SDPA_MIN_QUERIES_CACHED + 8
    assert m < n and 20 < attention.BF16_SDPA_MIN_QUERIES_CACHED
    seqs = [(37, 1), (n + 5, n + 5), (300, n), (200, m), (90, 20)]
    g = torch.Generator().manual_seed(3)
    bs = 16
    num_blocks = sum(-(-length // bs) for length, _ in seqs) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-length // bs))] for length, _ in seqs]
    t = sum(q for _, q in seqs)
    q = torch.randn(t, 9, 64, generator=g) * 2
    k, v = torch.randn(t, 3, 64, generator=g), torch.randn(t, 3, 64, generator=g)
    cached = [torch.randn(num_blocks, bs, 3, 64, generator=g).bfloat16().float() for _ in range(2)]
    rounded = [x.bfloat16().float() for x in (k, v)]
    got, plan = attend(seqs, torch.bfloat16, k, v, q, *cached, tables, bs)
    ref, _ = attend(seqs, torch.float32, *rounded, q, *cached, tables, bs)
    bf16 = [p for p in plan.prefills if p.dtype == torch.bfloat16]
    kernel_tiles = kernels_on and native.prefill_bf16_amx()
    assert len(bf16) == (3 if has_bf16_tiles("cpu") and not kernel_tiles else 0)
    if kernel_tiles:
        assert plan.native is not None and not plan.prefills
    assert got.dtype == torch.float32
    long_rows = slice(1, 1 + 2 * n + 5 + m)
    err = (got[long_rows] - ref[long_rows]).abs().max().item()
    if bf16 or (kernels_on and native.prefill_bf16_dot()):
        assert 0 < err < 5e-2  # queries and softmax weights rounded to bf16 (2^-8 relative)
    else:
        assert err < 1e-5
    exact = torch.cat([torch.arange(0, 1), torch.arange(1 + 2 * n + 5 + m, t)])
    torch.testing.assert_close(got[exact], ref[exact], atol=1e-5, rtol=1e-5)


def test_half_kv_far_from_float32_kv_on_unrounded_values_only_by_rounding(native):
    """Against float32 KV on the unrounded keys the difference is bf16's rounding, small but not zero."""
    g = torch.Generator().manual_seed(5)
    seqs, bs = [(200, 1), (64, 64)], 16
    tables = [list(range(13)), list(range(13, 17))]
    q = torch.randn(65, 9, 64, generator=g)
    k, v = torch.randn(65, 3, 64, generator=g), torch.randn(65, 3, 64, generator=g)
    cached = [torch.randn(17, bs, 3, 64, generator=g) for _ in range(2)]
    got, _ = attend(seqs, torch.bfloat16, k, v, q, *cached, tables, bs)
    ref, _ = attend(seqs, torch.float32, k, v, q, *cached, tables, bs)
    err = (got - ref).abs()
    assert 0 < float(err.max()) < 0.05


def engine(model, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_dtype", "bfloat16")
    return LLMEngine(model, EngineConfig(**kw), eos_token_ids=[2])


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_half_kv_output_does_not_depend_on_chunking_prefix_hits_or_preemption(
    tiny_llama, monkeypatch, kernels_on, kv
):
    # every query reads its keys as stored, a first chunk too: how a prompt was split changes nothing
    monkeypatch.setattr(kernels, "enabled", kernels_on)
    ps = prompts(9, 14, 7, 11, seed=3)
    ref = engine(tiny_llama.model, kv_cache_dtype=kv).generate(ps, GREEDY)
    assert engine(tiny_llama.model, kv_cache_dtype=kv, max_num_batched_tokens=5).generate(ps, GREEDY) == ref
    cached = engine(tiny_llama.model, kv_cache_dtype=kv)
    cached.generate(ps, GREEDY)
    assert cached.generate(ps, GREEDY) == ref  # full prompt blocks from the prefix cache
    assert cached.pool.prefix_hits > 0
    tight = engine(tiny_llama.model, kv_cache_dtype=kv, num_kv_blocks=14)
    assert tight.generate(ps, GREEDY) == ref
    assert tight.stats.preemptions > 0


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_bf16_kv_greedy_equals_float32_kv_on_tiny_models(request, model):
    """bf16 keeps 8 bits of mantissa (relative error <= 2^-9 per value); on these prompts no greedy
    choice of the tiny random models is that close, so 16 tokens each are identical (float16, with
    3 more bits, would be closer still). Kernels on and off give the same tokens too."""
    tiny = request.getfixturevalue(model)
    ps = prompts(9, 14, 7, 11, 20, seed=4)
    fp = engine(tiny.model, kv_cache_dtype="float32").generate(ps, GREEDY)
    assert engine(tiny.model).generate(ps, GREEDY) == fp


def test_bad_kv_cache_dtype_refused_with_the_choices():
    for bad in ("bf8", "int4", "", None, "BFLOAT16"):
        with pytest.raises(ValueError, match="unknown kv_cache_dtype.*'bfloat16'.*'int8'"):
            EngineConfig(kv_cache_dtype=bad)
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"  # the dtype aliases
    assert EngineConfig(kv_cache_dtype="fp16").kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="fp32").kv_cache_dtype == "float32"


def test_cli_refuses_a_bad_kv_cache_dtype_before_loading():
    from typer.testing import CliRunner

    from tokenops.cli import app

    result = CliRunner().invoke(app, ["engine", "--model", "no-such-model", "--kv-cache-dtype", "bf8"])
    assert result.exit_code == 2
    assert "unknown kv_cache_dtype 'bf8'" in result.output


@pytest.mark.parametrize(("kv", "dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_kv_doubles_the_blocks_for_the_same_budget(tiny_llama, kv, dtype):
    c = tiny_llama.config
    assert kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype) * 2 == kv_bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, torch.float32
    )
    budget = 1 << 20
    fp32 = LLMEngine(
        tiny_llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=budget, kv_cache_dtype="float32")
    )
    half = LLMEngine(
        tiny_llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
    )
    assert half.pool.num_blocks == budget // kv_bytes_per_block(c, 4, dtype) == 2 * fp32.pool.num_blocks
    assert half.runner.kv_caches[0][0].dtype == dtype
    assert half.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    assert half.memory_bytes["kv_cache"] == half.pool.num_blocks * kv_bytes_per_block(c, 4, dtype) <= budget
    load = half.load().to_dict()
    assert load["kv_cache_dtype"] == kv and load["kv_bytes_per_token"] == half.kv_bytes_per_token
    assert fp32.load().to_dict()["kv_cache_dtype"] == "float32"


def test_what_auto_resolves_to():
    f32, bf16 = torch.float32, torch.bfloat16
    for q in ("bf16", "int8_dynamic", "int4"):
        assert resolve_kv_dtype("auto", f32, q, native_bf16=True) == bf16
        assert resolve_kv_dtype("auto", f32, q, native_bf16=False) == f32  # no native bf16: float32
        assert resolve_kv_dtype("float32", f32, q, native_bf16=True) == f32  # the way to keep float32
    for q in (None, "int8"):
        assert resolve_kv_dtype("auto", f32, q, native_bf16=True) == f32
    # int4 on the block kernels (AVX2's auto weights): bf16 too; elsewhere without native bf16, float32
    assert resolve_kv_dtype("auto", f32, "int4", native_bf16=False, block_kernels=True) == bf16
    assert resolve_kv_dtype("auto", f32, "int4", native_bf16=False) == f32
    for q in ("bf16", "int8_dynamic", None, "int8"):  # only int4 runs on the block kernels' tiles
        assert resolve_kv_dtype("auto", f32, q, native_bf16=False, block_kernels=True) == f32
    assert resolve_kv_dtype("float32", f32, "int4", native_bf16=False, block_kernels=True) == f32
    assert resolve_kv_dtype("auto", bf16, None, native_bf16=False) == bf16  # a bf16 model: its own dtype
    assert resolve_kv_dtype("auto", torch.float16, "bf16", native_bf16=True) == torch.float16
    assert resolve_kv_dtype("bfloat16", f32, None, native_bf16=False) == bf16  # asked for: on any CPU
    assert resolve_kv_dtype("int8", f32, "bf16", native_bf16=True) == torch.int8


@pytest.fixture
def tiny_llama_copy(tiny_llama):
    """A private copy: quantisation replaces the model's linears in place."""
    import copy

    return copy.deepcopy(tiny_llama.model)


def test_engine_auto_kv_is_float32_without_weight_quantization(tiny_llama):
    plain = LLMEngine(tiny_llama.model, EngineConfig(num_kv_blocks=8))
    assert plain.kv_dtype == torch.float32 and plain.load().kv_cache_dtype == "float32"


@pytest.mark.parametrize("weights", ["bf16", "int8_dynamic", "int4"])
def test_engine_auto_kv_follows_the_weight_mode_and_the_cpu(tiny_llama_copy, weights):
    if weights == "int8_dynamic" and (reason := dynamic_int8_unavailable("cpu")):
        pytest.skip(reason)
    e = LLMEngine(tiny_llama_copy, EngineConfig(num_kv_blocks=8, quantization=weights))
    bf16_here = has_native_bf16("cpu") or (weights == "int4" and block_kernels("cpu"))
    want = torch.bfloat16 if bf16_here else torch.float32
    assert e.kv_dtype == want and e.load().kv_cache_dtype == str(want).removeprefix("torch.")
