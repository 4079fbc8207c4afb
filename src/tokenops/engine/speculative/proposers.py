"""Drafters: where the k speculative tokens of a sequence come from. `PromptLookupProposer` (n-gram)
matches the sequence's last n tokens against its own prompt and output, longest n first, and
proposes the k tokens after the most recent match that has k tokens after it (else the earliest);
it needs no model and its proposal is deterministic (q is one-hot). `DraftModelProposer` runs a
draft model autoregressively for k steps: a self-draft is the target's first N layers plus its final
norm and lm head, which write exactly the target's K/V for committed tokens and so share its paged
cache; a separate draft model keeps its own KV tensors under the same block tables, filled by
`mirror` over every batch the target runs. The draft's writes at draft positions are overwritten
when the target verifies them. Proposers choose tokens; they never decide how many (the scheduler
reserved the slots) or whether they are accepted (rejection).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tokenops.engine.context import ForwardContext, build_context
from tokenops.engine.models import CausalLM
from tokenops.engine.sampler import Sampler
from tokenops.engine.scheduler import ScheduledSequence


class PromptLookupProposer:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's tail."""
        if k < 1 or len(token_ids) < 2:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, len(arr) - 1), self.ngram_min - 1, -1):
            tail = arr[-n:]
            # windows that start before the tail itself; a match at i is followed by arr[i + n]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                # the most recent match with k tokens after it; else the earliest (the longest run)
                full = hits[hits + n + k <= len(arr)]
                start = int(full[-1] if full.size else hits[0]) + n
                return arr[start : start + k].tolist()
        return []

    def propose(self, entries: list[ScheduledSequence]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = [self.propose_one(e.seq.token_ids, e.num_lookahead) for e in entries]
        return drafts, [None] * len(entries)


class DraftModelProposer:
    def __init__(
        self, model: CausalLM, num_layers: int | None, kv_caches: list, block_size: int, device: torch.device
    ) -> None:
        """`num_layers`: N of a self-draft (N = all layers drafts with the target itself, every greedy
        draft accepted: a test setup); None for a separate draft model with its own `kv_caches`."""
        if num_layers is not None and num_layers > model.config.num_layers:
            raise ValueError(
                f"a self-draft of {num_layers} layers exceeds the {model.config.num_layers}-layer target"
            )
        self.model = model
        self.num_layers = num_layers
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def mirror(self, input_ids: torch.Tensor, ctx: ForwardContext) -> None:
        """Run a separate draft model over the target's batch, so its KV cache holds every token the
        target computed (the target's attention plan is shared: same lengths and block tables). Only
        the cache is wanted, so no row's output is: the last layer stops after storing K and V."""
        none = torch.empty(0, dtype=torch.long, device=input_ids.device)
        self.model(input_ids, replace(ctx, kv_caches=self.kv_caches), self.num_layers, rows=none)

    @torch.inference_mode()
    def propose(self, entries: list[ScheduledSequence]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft tokens per entry, and for sampled (non-greedy) requests the draft's probabilities
        q of each step ([k, V]), which the rejection rule needs."""
        drafts: list[list[int]] = [[] for _ in entries]
        qs: list[list[torch.Tensor]] = [[] for _ in entries]
        last = [e.seq.token_ids[-1] for e in entries]
        for j in range(max((e.num_lookahead for e in entries), default=0)):
            active = [i for i, e in enumerate(entries) if e.num_lookahead > j]
            # the step's input is the sequence's last known token (j = 0), then its previous draft
            ids = torch.tensor([last[i] for i in active], dtype=torch.long, device=self.device)
            ctx_lens = [entries[i].seq.num_computed_tokens + j + 1 for i in active]
            ctx = build_context(
                [1] * len(active),
                ctx_lens,
                [entries[i].seq.block_table for i in active],
                self.block_size,
                self.kv_caches,
                self.device,
            )
            logits = self.model.compute_logits(self.model(ids, ctx, num_layers=self.num_layers))
            tokens = logits.argmax(dim=-1).tolist()
            sampled = [r for r, i in enumerate(active) if not entries[i].seq.params.greedy]
            if sampled:
                probs = Sampler.probs(logits[sampled], [entries[active[r]].seq.params for r in sampled])
                for row, r in enumerate(sampled):
                    i = active[r]
                    tokens[r] = int(torch.multinomial(probs[row], 1, generator=entries[i].seq.generator))
                    qs[i].append(probs[row])
            for r, i in enumerate(active):
                drafts[i].append(tokens[r])
                last[i] = tokens[r]
        return drafts, [torch.stack(q) if q else None for q in qs]
