"""Running the model for one scheduled batch: build the forward context, run once, return logits.

The model runner owns the KV cache tensors and turns a `SchedulerOutput` into the flat batch the
model expects (token ids, positions, slots, block tables). It returns logits only for the rows that
sample, the last row of each sequence whose known tokens are all computed after this step, so a
prefill chunk that stops mid-prompt costs no vocabulary projection. It decides nothing about
who runs (scheduler) or which token is chosen (sampler).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenops.engine.context import ForwardContext, allocate_kv_caches, build_context
from tokenops.engine.kv_cache import kv_bytes_per_token
from tokenops.engine.models import CausalLM, ModelConfig
from tokenops.engine.scheduler import ScheduledSequence


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (int8: with its scales)."""
    return block_size * kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.block_size = block_size
        self.device = torch.device(device)
        # called with each step's (input ids, context) after the forward pass: a separate
        # speculative draft model runs the same batch to keep its own KV cache in step
        self.after_forward: Callable[[torch.Tensor, ForwardContext], None] | None = None
        self.kv_caches = allocate_kv_caches(
            self.config.num_layers, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim,
            kv_dtype, self.device,
        )

    def prepare(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Flat input ids, the forward context, and the indices (into `scheduled`) of sampling
        entries; an entry with k draft tokens has 1 + k consecutive logits rows, the others one."""
        input_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        gaps: list[tuple[int, int]] = []
        sample_rows: list[int] = []
        samplers: list[int] = []
        row = 0
        for i, entry in enumerate(scheduled):
            seq, n, drafts = entry.seq, entry.num_new_tokens, entry.num_lookahead
            start = seq.num_computed_tokens
            if n == 1:
                input_ids.append(seq.token_ids[start])
            else:
                input_ids.extend(seq.token_ids[start : start + n - drafts])
                input_ids.extend(entry.draft_token_ids)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            gaps.append((seq.kv_gap_start, seq.kv_gap_len))
            row += n
            if start + n - drafts == len(seq.token_ids):
                # a speculating entry samples at its last known token and at each draft token
                sample_rows.extend(range(row - 1 - drafts, row))
                samplers.append(i)
        ctx = build_context(query_lens, context_lens, tables, self.block_size, self.kv_caches, self.device, gaps)
        ctx.logits_indices = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, ctx, samplers

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor | None, list[int]]:
        """Run one step; return float32 logits [N, vocab] of the sampling rows, and the sampling entries."""
        ids, ctx, samplers = self.prepare(scheduled)
        hidden = self.model(ids, ctx)
        if self.after_forward is not None:
            self.after_forward(ids, ctx)
        if not samplers:
            return None, samplers
        if ctx.logits_indices.numel() < hidden.shape[0]:
            hidden = hidden[ctx.logits_indices]
        return self.model.compute_logits(hidden), samplers
