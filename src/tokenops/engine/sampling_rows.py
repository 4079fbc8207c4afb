"""`SamplingRows`: which rows of a step's logits belong to which scheduled entry.

The model runner computes logits only for the rows that choose a token: the last known token of each
entry whose known tokens are all computed after this step, plus one row per draft token of an entry
that speculates, so an entry owns 1 + (its draft tokens) consecutive rows. This module records that
layout and samples the plain entries' rows in one batch; it does not verify drafts (the speculator
does) or apply tokens to sequences (the scheduler does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenops.engine.sampler import Sampler
from tokenops.engine.scheduler import ScheduledSequence
from tokenops.engine.sequence import TokenLogprob


@dataclass(slots=True)
class SamplingRows:
    entries: list[int] = field(default_factory=list)  # indices into the step's scheduled entries, row order
    first_row: dict[int, int] = field(default_factory=dict)  # entry index -> its first logits row
    plain: list[int] = field(default_factory=list)  # entries with one row (no drafts to verify)
    speculating: list[int] = field(default_factory=list)  # entries with 1 + k rows

    @classmethod
    def of(cls, scheduled: list[ScheduledSequence], entries: list[int]) -> SamplingRows:
        rows, row = cls(entries=entries), 0
        for i in entries:
            rows.first_row[i] = row
            row += 1 + scheduled[i].num_lookahead
            (rows.speculating if scheduled[i].num_lookahead else rows.plain).append(i)
        return rows

    def __bool__(self) -> bool:
        return bool(self.entries)

    def draft_rows(self, logits: torch.Tensor, i: int, num_drafts: int) -> torch.Tensor:
        """Entry `i`'s [1 + num_drafts, V] rows: its last known token's, then one per draft."""
        start = self.first_row[i]
        return logits[start : start + 1 + num_drafts]

    def sample_plain(
        self, sampler: Sampler, logits: torch.Tensor, scheduled: list[ScheduledSequence]
    ) -> dict[int, tuple[int, TokenLogprob | None]]:
        """The token (and logprob, when asked for) of each plain entry, drawn in one sampler call."""
        if not self.plain:
            return {}
        if len(self.plain) == len(self.entries):
            rows = logits
        else:
            rows = logits[[self.first_row[i] for i in self.plain]]
        seqs = [scheduled[i].seq for i in self.plain]
        result = sampler(rows, [s.params for s in seqs], [s.generator for s in seqs])
        return {i: (result.token_ids[j], result.logprobs[j]) for j, i in enumerate(self.plain)}
