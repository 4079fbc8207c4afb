"""Attention over a paged KV cache.

`paged_attention` writes this step's keys and values into their slots, then attends each query
to its sequence's whole KV history, gathered from the sequence's blocks. Decode rows (one query per
sequence) are batched into one padded call; prefill chunks run one sequence at a time so that a
long chunk never pads every decode row to its length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenops.engine.context import ForwardContext


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    # flat views: [num_blocks * block_size, kv_heads, head_dim]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ctx: ForwardContext,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over their sequences' cached + new keys. -> [T, H, D]"""
    k_cache, v_cache = ctx.kv_caches[layer]
    write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    bs = ctx.block_size

    decode_seqs = [s for s, n in enumerate(ctx.query_lens) if n == 1]
    row_starts = [0]
    for n in ctx.query_lens:
        row_starts.append(row_starts[-1] + n)

    if decode_seqs:
        rows = torch.tensor([row_starts[s] for s in decode_seqs], device=q.device)
        lens = torch.tensor([ctx.context_lens[s] for s in decode_seqs], device=q.device)
        max_len = int(lens.max())
        pos = torch.arange(max_len, device=q.device)
        tables = ctx.block_tables[decode_seqs]  # [S, max_blocks]
        slots = tables.gather(1, (pos // bs).expand(len(decode_seqs), -1).clamp(max=tables.shape[1] - 1)) * bs + pos % bs
        keys = flat_k[slots]  # [S, L, KV, D]
        values = flat_v[slots]
        mask = pos[None, :] < lens[:, None]  # [S, L]
        if sliding_window is not None:
            mask &= pos[None, :] > (lens[:, None] - 1 - sliding_window)
        qs = q[rows].unsqueeze(2)  # [S, H, 1, D]
        o = F.scaled_dot_product_attention(
            qs, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )
        out[rows] = o.squeeze(2)

    for s, n in enumerate(ctx.query_lens):
        if n == 1:
            continue
        length = ctx.context_lens[s]
        slots = _gather_slots(ctx.block_tables[s], length, bs)
        keys = flat_k[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KV, L, D]
        values = flat_v[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        qpos = torch.arange(length - n, length, device=q.device)
        kpos = torch.arange(length, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > (qpos[:, None] - sliding_window)
        qs = q[row_starts[s] : row_starts[s + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row_starts[s] : row_starts[s + 1]] = o[0].transpose(0, 1)
    return out
