"""The native decode kernel (`tokenops::paged_decode_attention`) equals paged_attention's PyTorch decode
path: random non-contiguous block tables, ragged lengths (long enough that batch 1 splits its keys
across threads), several block sizes and GQA ratios, every KV dtype incl. int8, windows, evicted gaps;
and the native int8 KV write (`tokenops::quantize_kv_into`) is bitwise the PyTorch one."""

from __future__ import annotations

import pytest
import torch

from tokenops.engine import kernels
from tokenops.engine.attention import paged_attention
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches, write_kv

from .conftest import random_kv_cache

D = 64


@pytest.fixture(autouse=True)
def inference_mode():
    """As the engine runs its model: under autograd, attention and the KV write take the torch ops."""
    with torch.inference_mode():
        yield


def test_autograd_takes_the_torch_path(native):
    plans = []
    for grad in (False, True):
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            caches = allocate_kv_caches(1, 4, 4, 1, D, torch.float32)
            q, k, v = torch.randn(1, 2, D), torch.randn(1, 1, D), torch.randn(1, 1, D)
            ctx = build_context([1], [3], [[2]], 4, caches)
            paged_attention(q, k, v, ctx, 0, D**-0.5)
            plans.append(ctx.attn_plan.native)
    assert plans[0] is not None and plans[1] is None


def decode_both_ways(
    monkeypatch,
    lens,
    block_size,
    heads,
    kv_heads,
    kv_dtype,
    q_dtype=torch.float32,
    window=None,
    gaps=None,
    seed=0,
    torch_q_dtype=None,
):
    """One decode step for sequences of absolute lengths `lens` (gaps: evicted (start, length) each);
    -> (native output, PyTorch output). `torch_q_dtype`: run the PyTorch path on q, k, v cast to it."""
    g = torch.Generator().manual_seed(seed)
    kept = [n - (gaps[s][1] if gaps else 0) for s, n in enumerate(lens)]
    need = sum(-(-n // block_size) for n in kept)
    num_blocks = need + 8
    caches = random_kv_cache(num_blocks, block_size, kv_heads, D, kv_dtype, g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # random, non-contiguous blocks
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in kept]
    s = len(lens)
    q = (torch.randn(s, heads, D, generator=g) * 2).to(q_dtype)
    k = torch.randn(s, kv_heads, D, generator=g).to(q_dtype)
    v = torch.randn(s, kv_heads, D, generator=g).to(q_dtype)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setattr(kernels, "enabled", flag == "1")
        ctx = build_context([1] * s, list(lens), tables, block_size, caches, kv_gaps=gaps)
        cast = torch_q_dtype if flag == "0" and torch_q_dtype else q_dtype
        outs.append(paged_attention(q.to(cast), k.to(cast), v.to(cast), ctx, 0, D**-0.5, window))
        assert (ctx.attn_plan.native is not None) == (flag == "1")
    return outs


def assert_equal_paths(native_out, torch_out, dtype):
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert native_out.dtype == torch_out.dtype and native_out.shape == torch_out.shape
    torch.testing.assert_close(native_out, torch_out, **tol)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("lens", [[300], [1], [5, 70, 1, 33, 200, 16, 17]])
def test_float32_equals_torch_path(native, monkeypatch, block_size, heads, kv_heads, lens):
    got, ref = decode_both_ways(monkeypatch, lens, block_size, heads, kv_heads, torch.float32)
    assert_equal_paths(got, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("lens", [[257], [3, 90, 41, 12]])
def test_every_kv_dtype(native, monkeypatch, kv_dtype, lens):
    got, ref = decode_both_ways(monkeypatch, lens, 16, 9, 3, kv_dtype, seed=len(lens))
    assert_equal_paths(got, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_bfloat16_queries(native, monkeypatch, kv_dtype):
    # the kernel computes in float32 whatever the query dtype: it equals the float32 PyTorch path on the
    # same bfloat16 values, rounded to bfloat16 (the bfloat16 PyTorch path rounds at every op, int8's
    # dequantisation included, and differs from both by several bfloat16 steps)
    got, ref = decode_both_ways(
        monkeypatch, [130, 7, 64], 16, 9, 3, kv_dtype, q_dtype=torch.bfloat16, torch_q_dtype=torch.float32
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [1, 5, 64, 1000])
@pytest.mark.parametrize("lens", [[300], [4, 70, 1, 150]])
def test_sliding_window(native, monkeypatch, window, lens):
    got, ref = decode_both_ways(monkeypatch, lens, 4, 8, 2, torch.float32, window=window, seed=window)
    assert_equal_paths(got, ref, torch.float32)


@pytest.mark.parametrize("window", [None, 3, 20, 40, 200])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_evicted_gaps(native, monkeypatch, window, kv_dtype):
    # gaps of whole blocks; windows ending before, across and after the gap; one sequence without a gap
    lens, gaps = [300, 60, 45, 9], [(16, 128), (8, 24), (0, 0), (4, 4)]
    got, ref = decode_both_ways(monkeypatch, lens, 4, 9, 3, kv_dtype, window=window, gaps=gaps)
    assert_equal_paths(got, ref, torch.float32)


def test_single_thread_and_many(native, monkeypatch):
    # enough work to run on the thread pool: one long sequence split across threads (its key chunks
    # merged per kv head), and a batch; bfloat16 and int8 caches take the few-row path, all heads at once
    threads = torch.get_num_threads()
    shapes = (
        ([4500], 4, 1, torch.float32),
        ([300], 9, 3, torch.bfloat16),  # a short stream split too: chunks of 75 keys
        ([1500, 700, 3000], 8, 2, torch.float32),
        ([4500], 9, 3, torch.bfloat16),
        ([1500, 700, 3000, 64, 900], 9, 3, torch.bfloat16),
        ([4500, 33], 9, 3, torch.int8),
    )
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for lens, heads, kv_heads, kv_dtype in shapes:
                got, ref = decode_both_ways(monkeypatch, lens, 16, heads, kv_heads, kv_dtype)
                assert_equal_paths(got, ref, torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_a_mid_size_batch_is_the_same_bits_on_the_thread_pool(native):
    # 8 sequences of 61-96 keys (about 6,000 query-key pairs): enough to run on the thread pool, and at
    # up to 3 threads enough sequences (two per thread) that none has its keys split: each runs whole
    # on one thread, so the same bits as one thread
    g = torch.Generator().manual_seed(3)
    lens = [96, 61, 80, 90, 77, 64, 95, 70]
    block_size, heads, kv_heads = 16, 9, 3
    per = [-(-n // block_size) for n in lens]
    ((k_cache, v_cache),) = random_kv_cache(sum(per), block_size, kv_heads, D, torch.bfloat16, g)
    tables = torch.zeros(len(lens), max(per), dtype=torch.long)
    order = torch.randperm(sum(per), generator=g)
    at = 0
    for s, n in enumerate(per):
        tables[s, :n] = order[at : at + n]
        at += n
    q = torch.randn(len(lens), heads, D, generator=g)
    lens_t = torch.tensor(lens)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            args = (q, k_cache, v_cache, None, None, tables, lens_t, None, 0, D**-0.5)
            outs.append(native.paged_decode_attention(*args))
    finally:
        torch.set_num_threads(threads)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_length_beyond_table(native):
    cache = torch.zeros(4, 4, 1, D)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        native.paged_decode_attention(
            torch.zeros(1, 2, D),
            cache,
            cache,
            None,
            None,
            torch.tensor([[0, 1]]),
            torch.tensor([9]),
            None,
            0,
            1.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_write_is_bitwise_the_torch_write(native, monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 3, D, generator=g) * 4).to(dtype)
    x[0] = 0  # all-zero rows: the scale's lower bound
    x[1, :, :2] = torch.tensor([127.0, 63.5])  # a value exactly halfway between two steps: rounds to even
    slots = torch.randperm(16 * 8, generator=g)[:40]
    written = []
    for flag in ("1", "0"):
        monkeypatch.setattr(kernels, "enabled", flag == "1")
        ((k_cache, v_cache),) = allocate_kv_caches(1, 8, 16, 3, D, torch.int8)
        write_kv(x, -x, k_cache, v_cache, slots)
        written.append((k_cache, v_cache))
    for a, b in zip(*written, strict=True):
        assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
