"""Opt-in KV eviction for long contexts, attention sinks plus a recent window (StreamingLLM): with
`EngineConfig.kv_eviction = KVEvictionConfig(sink_tokens, window_tokens)` a sequence keeps the KV of
its first blocks and of its most recent `window_tokens` (up to one block more) and gives the whole
blocks in between back to the pool before each step, so it runs past its KV budget with bounded
memory. The sequence records the gap (`Sequence.kv_gap_start`, `kv_gap_len`); positions stay
absolute (keys are stored after RoPE and are not re-rotated, so positions beyond the trained context
stay out of reach), and blocks computed after an eviction are never indexed for prefix reuse. This
module decides which blocks go; the block pool frees them, the scheduler calls `evict` before it
sizes a sequence's next step, and attention reads the gap from the forward context.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenops.engine.block_pool import BlockPool
from tokenops.engine.config import KVEvictionConfig
from tokenops.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SinkWindowEviction:
    sink_blocks: int
    window_tokens: int
    block_size: int

    @classmethod
    def from_config(cls, config: KVEvictionConfig, block_size: int) -> SinkWindowEviction:
        return cls(-(-config.sink_tokens // block_size), config.window_tokens, block_size)

    def max_blocks_per_sequence(self, max_new_tokens: int) -> int:
        """Most blocks a sequence holds during a step of up to `max_new_tokens` new tokens."""
        bs = self.block_size
        return self.sink_blocks + -(-self.window_tokens // bs) + 1 + -(-max_new_tokens // bs) + 1

    def evict(self, seq: Sequence, pool: BlockPool) -> int:
        """Drop `seq`'s blocks that lie wholly between the sinks and the recent window; return how many."""
        bs = self.block_size
        # logical blocks before `window_start` end at or before the first token of the window
        window_start = (seq.num_computed_tokens - self.window_tokens) // bs
        evicted = seq.kv_gap_len // bs
        n = window_start - self.sink_blocks - evicted
        if n <= 0:
            return 0
        # the kept blocks after the sinks start at table index sink_blocks, whatever went before
        pool.drop_blocks(seq, self.sink_blocks, n)
        seq.kv_gap_start = self.sink_blocks * bs
        seq.kv_gap_len += n * bs
        return n
