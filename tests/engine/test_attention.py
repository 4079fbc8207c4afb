"""Paged attention equals dense causal attention: random non-contiguous block tables, several block
sizes, ragged batches mixing decodes and prefills, prefill on top of a cached prefix, sliding windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenops.engine.attention import paged_attention
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches

H, KV, D = 4, 2, 8


def dense(q, k, v, scale, window=None):
    """Reference: full causal attention of the last q.shape[0] positions over all of k/v."""
    n, length = q.shape[0], k.shape[0]
    qpos = torch.arange(length - n, length)
    kpos = torch.arange(length)
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    k = k.repeat_interleave(H // KV, dim=1)
    v = v.repeat_interleave(H // KV, dim=1)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    ).transpose(0, 1)


def run_case(block_size, cached, new, window=None, seed=0, num_blocks=64):
    """Sequence s holds cached[s] tokens from earlier steps and adds new[s] now."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(1, num_blocks, block_size, KV, D, torch.float32)
    free = torch.randperm(num_blocks, generator=g).tolist()  # random, non-contiguous blocks
    tables, full = [], []
    for c, n in zip(cached, new, strict=True):
        length = c + n
        tables.append([free.pop() for _ in range(-(-length // block_size))])
        full.append(
            (
                torch.randn(length, H, D, generator=g),
                torch.randn(length, KV, D, generator=g),
                torch.randn(length, KV, D, generator=g),
            )
        )
    # earlier steps: write the cached part through the kernel, one sequence at a time
    for s, c in enumerate(cached):
        if c:
            ctx = build_context([c], [c], [tables[s]], block_size, caches)
            q, k, v = full[s]
            paged_attention(q[:c], k[:c], v[:c], ctx, 0, 0.3, window)
    ctx = build_context(
        list(new), [c + n for c, n in zip(cached, new, strict=True)], tables, block_size, caches
    )
    q = torch.cat([f[0][c:] for f, c in zip(full, cached, strict=True)])
    k = torch.cat([f[1][c:] for f, c in zip(full, cached, strict=True)])
    v = torch.cat([f[2][c:] for f, c in zip(full, cached, strict=True)])
    out = paged_attention(q, k, v, ctx, 0, 0.3, window)
    row = 0
    for (fq, fk, fv), c, n in zip(full, cached, new, strict=True):
        ref = dense(fq[c:], fk, fv, 0.3, window)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
        row += n


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_ragged_batch_of_decodes_and_prefills(block_size):
    run_case(block_size, cached=[5, 0, 17, 0, 3], new=[1, 9, 1, 1, 6])


@pytest.mark.parametrize("block_size", [2, 16])
def test_prefill_on_top_of_cached_prefix(block_size):
    run_case(block_size, cached=[32, 16], new=[7, 16], num_blocks=128)


def test_single_decode_and_single_prefill():
    run_case(4, cached=[13], new=[1])
    run_case(4, cached=[0], new=[13])


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window):
    run_case(4, cached=[10, 0, 6], new=[1, 12, 5], window=window, seed=window)


def test_decode_rows_not_first_in_batch():
    run_case(4, cached=[0, 9, 0, 4], new=[5, 1, 3, 1])


def test_bfloat16_cache_close_to_dense():
    g = torch.Generator().manual_seed(1)
    caches = allocate_kv_caches(1, 8, 4, KV, D, torch.bfloat16)
    q, k, v = (
        torch.randn(10, H, D, generator=g),
        torch.randn(10, KV, D, generator=g),
        torch.randn(10, KV, D, generator=g),
    )
    ctx = build_context([9], [9], [[3, 1, 6]], 4, caches)
    paged_attention(q[:9], k[:9], v[:9], ctx, 0, 0.3)
    ctx = build_context([1], [10], [[3, 1, 6]], 4, caches)
    out = paged_attention(q[9:], k[9:], v[9:], ctx, 0, 0.3)
    torch.testing.assert_close(out, dense(q[9:], k, v, 0.3), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("native", [True, False])
def test_attention_from_fused_qkv_equals_the_separate_calls(kv_dtype, native, monkeypatch):
    """`paged_attention_qkv` (one native prologue on a float cache where every row is native) leaves
    the same cache and output as split + rope + `paged_attention`, on every path."""
    from tokenops.engine import kernels
    from tokenops.engine.attention import paged_attention_qkv
    from tokenops.engine.models.layers import RotaryEmbedding, rope_inv_freq

    if not native:
        monkeypatch.setattr(kernels, "enabled", False)
    elif kernels.ops() is None:
        pytest.skip("native kernels unavailable: " + str(kernels.build_error()))
    block_size, cached, new = 4, [6, 0, 9], [1, 5, 1]
    g = torch.Generator().manual_seed(3)
    free = torch.randperm(32, generator=g).tolist()
    tables = [
        [free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in zip(cached, new, strict=True)
    ]
    rotary = RotaryEmbedding(rope_inv_freq(D, 10000.0))
    outs, caches_after = [], []
    for fused in (True, False):
        caches = allocate_kv_caches(1, 32, block_size, KV, D, kv_dtype)
        gen = torch.Generator().manual_seed(5)
        for s, c in enumerate(cached):  # earlier steps' keys, written the same way both times
            if c:
                ctx = build_context([c], [c], [tables[s]], block_size, caches)
                qkv = torch.randn(c, (H + 2 * KV) * D, generator=gen)
                paged_attention_qkv(qkv, rotary(ctx.positions, torch.float32), ctx, 0, 0.3, H, KV, D)
        lens = [c + n for c, n in zip(cached, new, strict=True)]
        ctx = build_context(new, lens, tables, block_size, caches)
        qkv = torch.randn(sum(new), (H + 2 * KV) * D, generator=gen)
        rope = rotary(ctx.positions, torch.float32)
        with torch.inference_mode():
            if fused:
                out = paged_attention_qkv(qkv, rope, ctx, 0, 0.3, H, KV, D)
            else:
                q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
                q, k = rope(q.reshape(-1, H, D), k.reshape(-1, KV, D))
                out = paged_attention(q, k, v.reshape(-1, KV, D), ctx, 0, 0.3)
        outs.append(out)
        k_cache, v_cache = caches[0]
        caches_after.append([getattr(t, "data", t).clone() for t in (k_cache, v_cache)])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches_after[0], caches_after[1], strict=True):
        assert torch.equal(a, b)
