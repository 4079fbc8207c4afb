"""The work waiting at the gateway for one prefill worker's slots, counted by prompt block so that a
prefix the waiting legs share is counted once: the leg that goes first leaves it in the worker's cache
and the legs behind it compute only their own blocks. The live dispatch and the fleet simulator fill
`WorkerLoad.waiting_legs` / `waiting_prefill_tokens` from one `PrefillBacklog` per prefill worker.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LegBlocks:
    """What one prefill leg computes on its worker: the hashes of its prompt's blocks beyond the
    worker's cache, and the tokens no block hash stands for (the prompt's partial last block)."""

    blocks: tuple[int, ...]
    tail: int


def leg_blocks(hashes: Sequence[int], prompt_tokens: int, cached_tokens: int, block_tokens: int) -> LegBlocks:
    """A leg's blocks on a worker holding its prompt's first `cached_tokens` tokens. Its blocks and tail
    add up to its uncached tokens (a prompt without hashes is all tail), never more: text blocks that
    stand for more tokens than the prompt has are cut where the uncached tokens end."""
    uncached = max(prompt_tokens - cached_tokens, 0)
    first = cached_tokens // block_tokens
    blocks = tuple(hashes[first : first + uncached // block_tokens])
    return LegBlocks(blocks, uncached - len(blocks) * block_tokens)


class PrefillBacklog:
    """One prefill worker's legs at the gateway: those waiting for its slots and those under way there.
    `tokens` is what the waiting legs add to the worker's work: each distinct block among them that
    no leg under way there computes (or pulls) and no leg answered there left in its cache, plus their
    tails. Counters per block keep every step proportional to one leg's blocks; a leg leaving the wait
    takes exactly the blocks no other leg in line holds."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.legs = 0  # legs waiting
        self._waiting: collections.Counter[int] = collections.Counter()
        self._running: collections.Counter[int] = collections.Counter()
        # blocks of waiting legs that a leg answered here has since cached (forgotten with the wait)
        self._held: set[int] = set()
        self._tails = 0
        self._counted = 0  # blocks `_counts` says a waiting leg adds

    @property
    def tokens(self) -> int:
        return self._counted * self.block_tokens + self._tails

    def _counts(self, h: int) -> bool:
        return h in self._waiting and h not in self._running and h not in self._held

    def _step(self, counter: collections.Counter[int], hashes: Sequence[int], by: int) -> None:
        for h in hashes:
            before = self._counts(h)
            counter[h] += by
            if not counter[h]:
                del counter[h]
                if counter is self._waiting:
                    self._held.discard(h)
            self._counted += self._counts(h) - before

    def wait(self, leg: LegBlocks) -> None:
        self.legs += 1
        self._tails += leg.tail
        self._step(self._waiting, leg.blocks, 1)

    def unwait(self, leg: LegBlocks) -> None:
        """`leg` leaves the wait: let through (then `start` it) or withdrawn."""
        self.legs -= 1
        self._tails -= leg.tail
        self._step(self._waiting, leg.blocks, -1)

    def start(self, hashes: Sequence[int]) -> None:
        """A leg of a prompt of `hashes` is under way on the worker, which will hold them."""
        self._step(self._running, hashes, 1)

    def hold(self, hashes: Sequence[int]) -> None:
        """A leg answered: the worker's cache holds `hashes` now, so the waiting legs need not compute
        them (a leg placed from now on finds them in its cached prefix)."""
        for h in hashes:
            if h in self._waiting and h not in self._held:
                self._counted -= self._counts(h)
                self._held.add(h)

    def finish(self, hashes: Sequence[int]) -> None:
        """The leg under way is done (answered, after `hold`, or failed)."""
        self._step(self._running, hashes, -1)
