"""The per-step forward context: what a model's attention layers need to know about the batch. The
model runner builds one `ForwardContext` per step (`build_context`); model code reads it and never
sees sequences, blocks or the scheduler. The batch is flattened: T tokens from S sequences, sequence
s owning rows `cu_query_lens[s]:cu_query_lens[s+1]`. A sequence under KV eviction lists only the
blocks it kept, positions stay absolute (keys are stored after RoPE), and `kv_gaps[s] = (start,
length)` in tokens tells attention which absolute position each kept key has. The KV tensors it
carries are allocated by `kv_cache.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenops.engine.kv_cache import KVTensor


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat KV slot (block * block_size + offset) each token's K/V goes to
    block_tables: torch.Tensor  # [S, max_blocks] block ids per sequence (padding is never read)
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # KV length per sequence after this step (cached + new)
    block_size: int
    # per layer: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] (or int8 + scales)
    kv_caches: list[tuple[KVTensor, KVTensor]] = field(default_factory=list)
    # indices of the rows whose logits are wanted (usually each sequence's last token)
    logits_indices: torch.Tensor | None = None
    # derived per-step tensors the attention kernel computes on its first layer and reuses
    attn_plan: Any = None
    # per sequence: (first evicted position, evicted tokens); None when no sequence has evicted any
    kv_gaps: list[tuple[int, int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


def build_context(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    kv_caches: list[tuple[KVTensor, KVTensor]],
    device: torch.device | str = "cpu",
    kv_gaps: list[tuple[int, int]] | None = None,
) -> ForwardContext:
    """Derive positions, slots and the padded block table from per-sequence lengths and blocks.

    `kv_gaps[s] = (start, length)`: tokens [start, start + length) of sequence s were evicted (whole
    blocks); its block table lists the kept blocks only. New tokens always lie after the gap."""
    positions: list[int] = []
    slots: list[int] = []
    last_rows: list[int] = []
    row = 0
    bs = block_size
    for s, (q, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        start = ctx - q
        skip = kv_gaps[s][1] // bs if kv_gaps else 0  # evicted blocks before the new tokens
        if q == 1:  # decode: the common case, kept free of inner loops
            positions.append(start)
            slots.append(table[start // bs - skip] * bs + start % bs)
        else:
            positions.extend(range(start, ctx))
            slots.extend(table[p // bs - skip] * bs + p % bs for p in range(start, ctx))
        row += q
        last_rows.append(row - 1)
    width = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return ForwardContext(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_size=block_size,
        kv_caches=kv_caches,
        logits_indices=torch.tensor(last_rows, dtype=torch.long, device=device),
        kv_gaps=list(kv_gaps) if kv_gaps and any(n for _, n in kv_gaps) else None,
    )
