"""Per-sequence draft length that follows the sequence's recent acceptance rate.

Each speculating sequence keeps an exponentially weighted moving average of the fraction of its
draft tokens the target accepted. The next draft length is that fraction of the maximum (at least
one): text that copies its input keeps long drafts, free text shrinks them. When the average falls
below `min_acceptance` the sequence decodes plainly (length 0) for `cooldown_steps` steps, since a
rejected draft costs compute for nothing, then probes with a single draft token: an accepted probe
resumes speculation, a rejected one doubles the cooldown (up to 16 times `cooldown_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenops.engine.speculative.config import SpeculativeConfig


@dataclass(slots=True)
class DraftLength:
    config: SpeculativeConfig
    acceptance: float = 1.0  # EWMA of accepted / drafted; optimistic start
    cooldown: int = 0  # plain-decode steps left
    backoff: int = 1  # multiplier of cooldown_steps for the next cooldown
    probing: bool = False

    def next(self) -> int:
        """The draft length for this sequence's next step (0 = plain decode)."""
        k = self.config.num_tokens
        if not self.config.adaptive:
            return k
        if self.cooldown > 0:
            self.cooldown -= 1
            self.probing = self.cooldown == 0
            return 0
        if self.probing:
            return 1
        return max(1, min(k, math.ceil(k * self.acceptance)))

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0 or not self.config.adaptive:
            return
        if self.probing:
            self.probing = False
            if accepted:
                self.acceptance, self.backoff = 0.5, 1
            else:
                self.backoff = min(2 * self.backoff, 16)
                self.cooldown = self.config.cooldown_steps * self.backoff
            return
        w = self.config.ewma_weight
        self.acceptance = (1 - w) * self.acceptance + w * (accepted / drafted)
        if self.acceptance < self.config.min_acceptance and self.config.cooldown_steps > 0:
            self.cooldown = self.config.cooldown_steps * self.backoff
