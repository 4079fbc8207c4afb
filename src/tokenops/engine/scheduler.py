"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Each call to `schedule()` builds one batch under two limits, `max_num_seqs` running sequences and a
token budget of `max_num_batched_tokens`. Running decodes go first (one token each), then running
sequences still in prefill, then waiting requests in (priority, arrival) order; a prefill takes as
much of the remaining budget as it can, up to `max_chunk_tokens`, and continues in the next step
(chunked prefill), so a long prompt never stalls the decodes. A step with no decode to stall (every
running sequence two or more tokens from its next sample) lets its first prefill run to
`max_prefill_step_tokens`: a prompt of up to that length is then one causal chunk. When the KV
pool cannot hold a running sequence's next tokens, the least important running sequence (highest
priority number, latest arrival) is preempted: its blocks are freed and it goes back to the waiting
queue to be recomputed later (mostly from the prefix cache). With KV eviction configured, each
sequence first drops the blocks between its attention sinks and its recent window (kv_eviction.py),
so its length is bounded by the model, not by the pool. `update()` applies a step's sampled tokens
and finishes sequences. The scheduler never runs a model and never touches tensors; it is tested
with plain `Sequence` objects.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tokenops.engine.block_pool import BlockPool
from tokenops.engine.config import ContextLengthExceeded, EngineConfig
from tokenops.engine.kv_eviction import SinkWindowEviction
from tokenops.engine.sequence import Sequence, SequenceStatus

# waiting requests a step sets aside for a block another prefill computes before it stops looking
# further down the queue: each costs a prefix-cache lookup, and a long queue behind one shared head
# would otherwise be walked every step
MAX_DEFERRED_PER_STEP = 16


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    # speculative decoding: slots after the known tokens, filled with draft tokens to verify
    num_lookahead: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so it gets a new one."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_lookahead == len(
            self.seq.token_ids
        )


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] | list[int] = (),
    ) -> None:
        self.config = config
        self.pool = pool
        self.eviction = (
            SinkWindowEviction.from_config(config.kv_eviction, pool.block_size)
            if config.kv_eviction
            else None
        )
        # a sequence longer than the pool could never be resumed after preemption (unless it evicts)
        self.max_model_len = (
            max_model_len if self.eviction else min(max_model_len, pool.num_blocks * pool.block_size)
        )
        self.num_evicted_blocks = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq)
        self._num_waiting = 0
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; raise `ContextLengthExceeded` if it could never run."""
        if len(seq.token_ids) + 1 > self.max_model_len:
            raise ContextLengthExceeded(len(seq.token_ids), self.max_model_len)
        if not seq.token_ids:
            raise ValueError("a request needs at least one prompt token")
        self._push(seq)

    def _push(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        # finished (aborted) entries are dropped lazily
        while self._waiting and self._waiting[0][2].status is not SequenceStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    @property
    def waiting(self) -> list[Sequence]:
        return [s for _, _, s in sorted(self._waiting) if s.status is SequenceStatus.WAITING]

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` now (stop, length, abort): free its blocks and drop it from the queues."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1
        else:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.pool.free(seq)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # running sequences: decodes first, then prefills in progress, each in importance order
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.priority, s.arrival))
        budget = self._step_budget(order)
        step_budget = budget
        chunk_cap = self.config.max_chunk_tokens or budget
        scheduled_ids: set[int] = set()

        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self.eviction:
                self.num_evicted_blocks += self.eviction.evict(seq, self.pool)
            n = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            lookahead = min(seq.num_lookahead, budget - n) if seq.num_uncomputed_tokens == 1 else 0
            if lookahead and not self.pool.can_allocate(seq, n + lookahead):
                lookahead = 0  # speculation never preempts anyone
            n += lookahead
            while not self.pool.can_allocate(seq, n):
                victim = max(self.running, key=lambda s: (s.priority, s.arrival))
                if id(victim) in scheduled_ids:
                    entry = next(e for e in out.scheduled if e.seq is victim)
                    out.scheduled.remove(entry)
                    scheduled_ids.discard(id(victim))
                    budget += entry.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.pool.allocate(seq, n)
                out.scheduled.append(ScheduledSequence(seq, n, lookahead))
                scheduled_ids.add(id(seq))
                budget -= n

        # waiting requests, in (priority, arrival) order; none are admitted in a step that preempted
        bs = self.pool.block_size
        # the blocks the prefills of this step start with: a request whose next uncached block is
        # one of them (an identical prompt, the other choices of an n > 1 request, or one prompt's
        # head in the middle of being prefilled) waits a step and then reuses it from the prefix
        # cache, keeping its place in the queue while the requests behind it go ahead; one that
        # shares only cached blocks (a common system prompt) is admitted at once
        deferred: list[tuple[int, int, Sequence]] = []
        prefilling = (
            {
                key
                for e in out.scheduled
                if e.seq.num_uncomputed_tokens > 1 and (key := self._next_block_key(e.seq)) is not None
            }
            if self.pool.enable_prefix_caching and self._num_waiting
            else set()
        )
        while budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None or (deferred and seq.priority > deferred[0][0]):
                break  # only requests of a set-aside one's priority go ahead of it
            cached = self.pool.allocate_prefix(seq, record=False) if not seq.block_table else 0
            key = self._next_block_key(seq) if self.pool.enable_prefix_caching else None
            if key in prefilling and cached < (len(seq.token_ids) - 1) // bs * bs:
                self.pool.free(seq)
                deferred.append(heapq.heappop(self._waiting))
                if len(deferred) == MAX_DEFERRED_PER_STEP:
                    break
                continue
            if self.eviction:
                self.num_evicted_blocks += self.eviction.evict(seq, self.pool)
            n = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            if not self.pool.can_allocate(seq, n):
                self.pool.free(seq)  # give back the prefix blocks; they stay cached for next time
                break
            if seq.num_cached_tokens < 0:  # first admission: this is the request's prefix-cache query
                seq.num_cached_tokens = cached
                if self.pool.enable_prefix_caching:
                    self.pool.record_query(seq.num_prompt_tokens, min(cached, seq.num_prompt_tokens))
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            self.pool.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            if key is not None:
                prefilling.add(key)

        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        out.num_batched_tokens = step_budget - budget
        return out

    def _step_budget(self, order: list[Sequence]) -> int:
        """`max_num_batched_tokens`, or, where no running sequence is one token from its next sample,
        as much of `max_prefill_step_tokens` as the first prefill (the first of `order`, else the
        head of the queue) has left to compute, up to `max_chunk_tokens`."""
        budget, longest = self.config.max_num_batched_tokens, self.config.max_prefill_step_tokens
        if longest <= budget or (order and order[0].num_uncomputed_tokens <= 1):
            return budget
        first = order[0] if order else self._peek_waiting()
        if first is None:
            return budget
        left = min(first.num_uncomputed_tokens, self.config.max_chunk_tokens or longest)
        return min(longest, max(budget, left))

    def _next_block_key(self, seq: Sequence) -> int | None:
        """The prefix-cache hash of the full block holding `seq`'s first uncomputed token, or None
        (the block ends past the known tokens, or the chain of hashes before it is not known)."""
        bs = self.pool.block_size
        i = seq.num_computed_tokens // bs
        if (i + 1) * bs > len(seq.token_ids) or len(seq.block_hashes) != i or seq.kv_gap_len:
            return None  # (after a KV eviction its blocks are never cached: nothing to wait for)
        parent = seq.block_hashes[-1] if i else self.pool.root_hash
        return self.pool.hash_fn(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push(seq)

    def update(self, output: SchedulerOutput, sampled: list[int | list[int] | None]) -> list[Sequence]:
        """Apply a step's results. `sampled[i]` is the token for `output.scheduled[i]` (None if it
        did not sample), or for a speculating entry the accepted drafts followed by the target's
        token. Tokens after a stop are dropped. Returns the sequences that finished in this step."""
        finished: list[Sequence] = []
        for i, entry in enumerate(output.scheduled):
            seq = entry.seq
            tokens = sampled[i]
            tokens = [] if tokens is None else [tokens] if isinstance(tokens, int) else tokens
            computed = seq.num_computed_tokens + entry.num_new_tokens - entry.num_lookahead
            reason = None
            for token in tokens:
                seq.token_ids.append(token)
                reason = self.check_stop(seq, token)
                if reason is not None:
                    break
            if entry.num_lookahead:
                # accepted drafts have valid K/V; the target's own last token is not computed yet
                computed = min(computed + len(tokens) - 1, len(seq.token_ids))
            if tokens:
                # slots of rejected (or never proposed) drafts are rolled back: their blocks go back
                self.pool.trim(seq, len(seq.token_ids))
            seq.num_computed_tokens = computed
            self.pool.cache_full_blocks(seq)  # hashes cover computed (committed) tokens only
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None
