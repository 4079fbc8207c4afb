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
