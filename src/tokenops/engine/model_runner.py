"""Running the model for one scheduled batch: build the forward context, run once, return logits.

The model runner holds the target's KV cache tensors (allocated by `kv_cache.py`) and turns the
scheduled entries into the flat batch the model expects (token ids, positions, slots, block tables).
It returns logits only for the rows that choose a token (`SamplingRows`), so a prefill chunk that
stops mid-prompt costs no vocabulary projection. It decides nothing about who runs (scheduler) or
which token is chosen (sampler, speculator).
"""

from __future__ import annotations

import torch

from tokenops.engine.context import ForwardContext, build_context
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.models import CausalLM, ModelConfig
from tokenops.engine.sampling_rows import SamplingRows
from tokenops.engine.scheduler import ScheduledSequence


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
        self.kv_caches = allocate_kv_caches(
            self.config.num_layers,
            num_blocks,
            block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
            kv_dtype,
            self.device,
        )

    def prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, ForwardContext, SamplingRows]:
        """Flat input ids, the forward context, and which logits rows belong to which entry."""
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
        ctx = build_context(
            query_lens, context_lens, tables, self.block_size, self.kv_caches, self.device, gaps
        )
        ctx.logits_indices = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, ctx, SamplingRows.of(scheduled, samplers)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, rows: SamplingRows) -> torch.Tensor | None:
        """One forward pass; float32 logits [N, vocab] of the sampling rows (None when none samples)."""
        keep = ctx.logits_indices
        # a prefill row that samples nothing needs its K and V only: the last layer skips its MLP
        hidden = self.model(input_ids, ctx, rows=keep if keep.numel() < input_ids.numel() else None)
        if not rows:
            return None
        return self.model.compute_logits(hidden)
