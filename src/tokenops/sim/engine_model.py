"""One simulated engine replica: continuous batching under `max_num_seqs` and `max_num_batched_tokens`,
chunked prefill, a paged KV pool with a prefix cache of chained block hashes, preemption by recompute
when the pool runs out, and step times from the one `PerfModel`.

The scheduling rules follow our engine's scheduler (`tokenops.engine.scheduler`): running decodes go
first (one token each), then prefills in progress, then waiting requests, each in the order they were
added to the replica and each taking what is left of the token budget; when the pool cannot hold a
running sequence's next tokens the one added last is preempted and recomputed later, mostly from the
prefix cache (decode rows ahead of the victim first take every free and evictable block, as the
engine grants rows one by one); no waiting request is admitted in a step that preempted. Decode rows
are kept in aggregate (their count, the sum of their contexts, how many cross a block boundary at
each step, a heap of finishing steps), so a step costs O(prefill chunks + finishing rows), not
O(batch). This module owns one replica; which replica a request goes to, and KV transfer between
replicas, are the fleet's (fleet.py).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenops.cluster.pd import StreamProgress
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.prefix_index import PrefixIndex

# the engine scheduler's MAX_DEFERRED_PER_STEP (not imported: the engine's modules bring torch)
MAX_DEFERRED_PER_STEP = 16
# the step limits an engine reports under `/v1/load`'s "scheduler"
_SCHEDULER_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "max_chunk_tokens", "max_prefill_step_tokens")


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine knobs the model honours (names as `tokenops.engine.config.EngineConfig`)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int = 4096
    enable_prefix_caching: bool = True
    max_chunk_tokens: int | None = None  # cap on one prefill's chunk per step (None: the whole budget)
    # a step with no row one token from its sample lets its first prefill run to this many tokens
    # (None: the step budget, as the engine on CPUs without AMX)
    max_prefill_step_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running decode takes one token of the budget, as in vLLM
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        if self.max_prefill_step_tokens is not None and self.max_prefill_step_tokens < 1:
            raise ValueError("max_prefill_step_tokens must be >= 1")

    @classmethod
    def of_engine(cls, load: Mapping[str, Any], like: EngineShape | None = None) -> EngineShape:
        """The shape a live engine runs, from its `/v1/load` report: its pool, block size and step
        limits as it resolved them (the prefill step depends on its CPU); what the report lacks (an
        older engine, another server) comes from `like`, else the defaults."""
        limits = load.get("scheduler") or {}
        found = {k: limits[k] for k in _SCHEDULER_LIMITS if k in limits}
        for name, key in (("block_size", "block_size"), ("num_kv_blocks", "kv_blocks_total")):
            if load.get(key):
                found[name] = int(load[key])
        return dataclasses.replace(like or cls(), **found)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


class SimRequest:
    """One request's life inside the simulated fleet, and the timings that become its `RequestRecord`."""

    __slots__ = (
        "id", "session_id", "round", "arrival", "prompt_tokens", "max_tokens", "hashes", "cache_hashes",
        "target", "computed", "generated", "shared", "private_blocks", "cached_tokens", "token_times",
        "join_step", "epoch", "prefill_only", "replica", "prefill_replica", "decode_replica",
        "transfer_tokens", "done", "reason", "queued_tokens", "order", "published",
    )  # fmt: skip

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt_tokens: int,
        max_tokens: int,
        hashes: Sequence[int] = (),
        cache_hashes: Sequence[int] = (),
        session_id: str | None = None,
        round_: int = 0,
    ) -> None:
        self.id = rid
        self.session_id = session_id
        self.round = round_
        self.arrival = arrival
        self.prompt_tokens = max(1, prompt_tokens)
        self.max_tokens = max(1, max_tokens)
        self.hashes = hashes  # chained hashes of the prompt's full blocks (what the gateway's policies see)
        # hashes of the whole sequence's blocks (prompt and answer, known from the session's next round)
        self.cache_hashes = cache_hashes if len(cache_hashes) > len(hashes) else hashes
        self.target = self.prompt_tokens  # tokens to hold in KV before the next sample
        self.computed = 0
        self.generated = 0
        self.shared: list[int] = []  # block hashes it holds in the prefix cache (ref-counted)
        self.published = 0  # leading blocks indexed or left out as duplicates (the engine's block_hashes)
        self.private_blocks = 0
        self.cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.token_times: list[float] = []
        self.join_step = 0  # the step whose sample made it a decode row
        self.epoch = 0  # bumps on preemption so stale finish entries are ignored
        self.prefill_only = False
        self.replica = ""
        self.prefill_replica: str | None = None
        self.decode_replica = ""
        self.transfer_tokens = 0
        self.done = False
        self.reason = ""
        self.queued_tokens = 0  # its uncached prompt tokens while it waits (what a load report counts)
        self.order = 0  # its place among the requests added to its replica (the engine's arrival)


def _insert_in_order(queue: deque[SimRequest] | list[SimRequest], r: SimRequest) -> None:
    """Insert r into `queue`, kept in the order its requests were added to the replica (r usually goes
    last, so the search runs from the end)."""
    at = len(queue)
    while at and queue[at - 1].order > r.order:
        at -= 1
    queue.insert(at, r)


class ReplicaEngine:
    """A simulated engine. `add` queues a request for prefill, `add_decode` one whose prompt KV was
    shipped from a prefill replica; callbacks report each finish (and, on a prefill-only replica, each
    finished prefill)."""

    def __init__(
        self,
        rid: str,
        perf: PerfModel,
        shape: EngineShape,
        loop,  # tokenops.sim.events.EventLoop
        on_finish: Callable[[SimRequest], None],
        on_prefilled: Callable[[SimRequest], None] | None = None,
        role: str = "both",
        index: PrefixIndex | None = None,
        sample_every_s: float = 1.0,
        host_contention: float = 0.0,
    ) -> None:
        self.id = rid
        self.role = role
        self.perf = perf
        self.shape = shape
        self.loop = loop
        self.on_finish = on_finish
        self.on_prefilled = on_prefilled
        self.index = index  # a policy's prefix index this replica keeps exact (stores and evictions)
        # engines sharing this one's cores (CPU replicas on one host): each that has work while a step
        # starts makes the step `host_contention` slower (measured by calibrate.measure_contention)
        self.host_contention = host_contention
        self.neighbours: list[ReplicaEngine] = []
        bs = shape.block_size
        self.bs = bs
        self.total_blocks = shape.num_kv_blocks
        self.caching = shape.enable_prefix_caching
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # in the order they were added, as the engine runs them
        self._added = 0
        self.decoding: dict[int, SimRequest] = {}
        self.waiting_tokens = 0  # uncached prompt tokens queued, as a PD snapshot reports them
        self.n_decode = 0
        self.decode_ctx_offset = 0  # sum of (target - join_step): a row's context is that plus the step
        self.phase = [0] * bs  # rows by (target - join_step) mod block size: who needs a block when
        self.finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self.step_no = 0  # last completed step
        self.step_times: list[float] = [0.0]  # end time of each step; step 0 is the origin
        self.busy = False
        self.used_private = 0
        self.in_use: dict[int, int] = {}  # cached block hash -> running sequences holding it
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks that keep their content (LRU)
        self._batch: list[tuple[SimRequest, int]] = []
        # what reaches the engine from other threads (requests with their KV imports, the pins and
        # unpins for a peer) runs on its thread between steps: what arrives mid-step waits here
        self._stepping = False
        self._inbox: list[tuple[Callable[[Any], None], Any]] = []
        # blocks pinned for a peer, by request: a prefill leg's hold, a pull of history under way
        self._pinned: dict[int, list[int]] = {}
        self._step_started = 0.0
        self.step_ends = 0.0  # when the step last planned ends (in the past while idle)
        self._rows_allocated_for = 0  # the step whose decode-row blocks are allocated
        # accounting
        self.busy_s = 0.0
        self.steps = 0
        self.preemptions = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.sample_every_s = sample_every_s
        self._next_sample = 0.0
        self.kv_timeline: list[tuple[float, float, int]] = []  # (time, KV in use 0..1, running)
        self.last_itl_s: float | None = None

    # -- what the fleet reads ----------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self.n_decode + len(self.prefilling)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def streams(self) -> tuple[StreamProgress, ...]:
        """Its answers under way, as a gateway relaying them sees them: each decode row's gaps so far,
        their sum and the tokens still to come; a request still prefilling or waiting here has none
        of its gaps yet."""
        step, times = self.step_no, self.step_times
        out = []
        for r in self.decoding.values():
            n = r.generated + step - r.join_step  # tokens so far
            first = r.token_times[0] if r.token_times else times[r.join_step + 1]
            last = times[step] if step > r.join_step else r.token_times[-1]
            out.append(StreamProgress(max(0, n - 1), last - first, max(0, r.max_tokens - n)))
        out.extend(
            StreamProgress(0, 0.0, r.max_tokens - r.generated)
            for r in (*self.prefilling, *self.waiting)
            if not r.prefill_only
        )
        return tuple(out)

    def available_blocks(self) -> int:
        return self.total_blocks - self.used_private - len(self.in_use)

    def kv_usage(self) -> float:
        return (self.used_private + len(self.in_use)) / self.total_blocks

    def context_tokens(self) -> int:
        ctx = self.decode_ctx_offset + self.n_decode * self.step_no
        return ctx + sum(r.computed for r in self.prefilling)

    def prefill_backlog(self) -> int:
        """Prompt tokens still to compute here: the queued prompts' uncached tokens and what the
        prefills in progress have left (they share the next steps with any newcomer)."""
        return self.waiting_tokens + sum(r.target - r.computed for r in self.prefilling)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` this replica's KV holds (running or cached), without touching LRU."""
        if not self.caching:
            return 0
        in_use, cached = self.in_use, self.cached
        n = 0
        for h in hashes:
            if h in in_use or h in cached:
                n += 1
            else:
                break
        return n

    def _between_steps(self, fn: Callable[[Any], None], arg: Any) -> None:
        if self._stepping:
            self._inbox.append((fn, arg))
        else:
            fn(arg)

    def import_prefix(self, hashes: Sequence[int]) -> None:
        """Blocks of a chain shipped in from another replica land in the prefix cache, between steps."""
        self._between_steps(self._import_prefix, hashes)

    def pin_for_peer(self, r: SimRequest, hashes: Sequence[int]) -> None:
        """A peer's pull of these cached blocks begins: as the KV server pins them (between steps),
        the leading run held here is out of eviction's reach until `unpin_for_peer`."""
        self._between_steps(self._pin_for_peer, (r.id, hashes))

    def _pin_for_peer(self, arg: tuple[int, Sequence[int]]) -> None:
        rid, hashes = arg
        self._pinned[rid] = self._pin(hashes)

    def unpin_for_peer(self, r: SimRequest) -> None:
        """A peer's pull of r's blocks has landed, or a prefill leg's hold ends: the blocks pinned for
        it are released between steps, tail first (the head the LRU-newest)."""
        self._between_steps(self._unpin_for_peer, r.id)

    def _unpin_for_peer(self, rid: int) -> None:
        self._unpin(self._pinned.pop(rid))
        self._wake()  # the freed room may admit a waiting request

    def _import_prefix(self, hashes: Sequence[int]) -> None:
        """Blocks of a chain shipped in from another replica land in the prefix cache, and in an exact
        prefix index as the live engine's stored and evicted events put them. As the engine's
        `import_kv`: the chain is held while it is written (the cached blocks it passes through and
        each one written), so making room evicts only other blocks and the import stops when none is
        left; then the chain is released tail first, its head the LRU-newest."""
        if not self.caching:
            return
        in_use, cached, index = self.in_use, self.cached, self.index
        held: list[int] = []
        stored: list[int] = []  # new here, indexed once the import is done
        free = self.total_blocks - self.used_private - len(in_use) - len(cached)
        for h in hashes:
            if h in in_use:
                continue
            if h in cached:
                del cached[h]
            elif free > 0:
                free -= 1
                stored.append(h)
            elif cached:
                old, _ = cached.popitem(last=False)
                if index is not None:
                    index.remove((old,), self.id)
                stored.append(h)
            else:
                break
            held.append(h)
        for h in reversed(held):
            cached[h] = None
        if stored and index is not None:
            index.insert(stored, self.id)

    # -- arrivals ------------------------------------------------------------------------------------

    def add(self, r: SimRequest, kv: Sequence[int] = ()) -> None:
        """A request reaches the engine, which takes it on its thread between steps, with the blocks
        of its prompt a peer sent (`kv`, a chain's hashes) imported first, as `add_request` does."""
        r.replica = self.id
        self._between_steps(self._add, (r, kv))

    def _add(self, arg: tuple[SimRequest, Sequence[int]]) -> None:
        r, kv = arg
        if kv:
            self._import_prefix(kv)
        # the engine orders a request by when it was added to it, not when it reached the gateway (a
        # decode leg arrives here after its prefill elsewhere)
        self._added += 1
        r.order = self._added
        self.waiting.append(r)
        self._queue_tokens(r)
        self._wake()

    def add_decode(self, r: SimRequest) -> None:
        """A sequence prefilled elsewhere whose KV has arrived. As the live decode leg, it is a new
        request whose prompt's whole blocks land in the prefix cache as it is added (they can be
        evicted while it waits, and are then recomputed): it waits its turn, then its first step
        takes those blocks from the cache, computes the rest (at least the last token) beside the
        running batch and samples its first token."""
        self.add(r, r.cache_hashes[: r.target // self.bs])

    def _queue_tokens(self, r: SimRequest) -> None:
        # a long session's history sits in the prefix cache: only the rest is queued work
        held = self.cached_prefix_blocks(r.cache_hashes[: (r.target - 1) // self.bs]) * self.bs
        r.queued_tokens = r.target - held
        self.waiting_tokens += r.queued_tokens

    def _wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._plan, None)

    # -- KV pool ---------------------------------------------------------------------------------------

    def _allocate(self, n: int) -> bool:
        free = self.total_blocks - self.used_private - len(self.in_use) - len(self.cached)
        if n > free:
            short = n - free
            if short > len(self.cached):
                return False
            pop = self.cached.popitem
            if self.index is None:
                for _ in range(short):
                    pop(last=False)
            else:
                for _ in range(short):
                    h, _ = pop(last=False)
                    self.index.remove((h,), self.id)
        self.used_private += n
        return True

    def _take_prefix(self, r: SimRequest) -> int:
        """Ref the leading cached blocks of r's sequence; the last token is always computed."""
        if not self.caching:
            return 0
        r.shared = self._pin(r.cache_hashes[: (r.target - 1) // self.bs])
        r.published = len(r.shared)
        return r.published

    def _pin(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the leading held blocks of `hashes` (in use or cached), to the first
        one not held, as the engine's `pin_cached`; returns their hashes."""
        in_use, cached = self.in_use, self.cached
        pinned = []
        for h in hashes:
            if h in in_use:
                in_use[h] += 1
            elif h in cached:
                del cached[h]
                in_use[h] = 1
            else:
                break
            pinned.append(h)
        return pinned

    def _unpin(self, hashes: Sequence[int]) -> None:
        """Drop references, tail first, as the engine's `unpin` and `free`: a block no one holds
        becomes the LRU-newest, so the head of a run ends newest."""
        in_use, cached = self.in_use, self.cached
        for h in reversed(hashes):
            c = in_use[h] - 1
            if c:
                in_use[h] = c
            else:
                del in_use[h]
                cached[h] = None

    def _next_block(self, r: SimRequest) -> int | None:
        """The hash of the full block holding r's first uncomputed token, or None where that block
        reaches past the tokens known so far (its hashes run on into the answer to come)."""
        i = r.computed // self.bs
        return r.cache_hashes[i] if (i + 1) * self.bs <= r.target and i < len(r.cache_hashes) else None

    def _publish(self, r: SimRequest) -> None:
        """r's full computed blocks join the prefix cache while it runs, as the engine indexes a
        sequence's blocks after each step: a request admitted later shares them. As in the engine, a
        block whose hash is already held (another request computed the same one, or it was imported
        meanwhile) is left out: it stays r's own and is freed as a plain block."""
        hashes = r.cache_hashes
        start = r.published
        end = min(r.computed // self.bs, len(hashes))
        if end <= start:
            return
        r.published = end
        in_use, cached = self.in_use, self.cached
        seg = hashes[start:end]
        if not (in_use.keys().isdisjoint(seg) and cached.keys().isdisjoint(seg)):  # rare
            seg = [h for h in seg if h not in in_use and h not in cached]
        if seg:
            in_use.update(dict.fromkeys(seg, 1))
            r.shared.extend(seg)
            r.private_blocks -= len(seg)
            self.used_private -= len(seg)
            if self.index is not None:
                self.index.insert(seg, self.id)

    def _release(self, r: SimRequest, kv_tokens: int) -> None:
        """Give back r's blocks; its full blocks stay in the prefix cache under their hashes. As the
        engine frees a sequence, tail first: its last block becomes the LRU-oldest and its first the
        newest, so within a freed sequence eviction takes the tail first and the reachable head last."""
        self.used_private -= r.private_blocks
        r.private_blocks = 0
        in_use, cached = self.in_use, self.cached
        fresh: list[int] = []
        if self.caching:
            # the answer's full blocks, which the engine indexes as they fill, join the cache now
            for h in reversed(r.cache_hashes[r.published : kv_tokens // self.bs]):
                if h not in in_use and h not in cached:
                    cached[h] = None
                    fresh.append(h)
        self._unpin(r.shared)
        r.shared = []
        r.published = 0
        if not self.caching:
            return
        over = len(cached) + len(in_use) + self.used_private - self.total_blocks
        index = self.index
        if index is None:
            pop = cached.popitem
            for _ in range(over):
                pop(last=False)
            return
        new, evicted = set(fresh), set()
        for _ in range(over):
            h, _ = cached.popitem(last=False)
            if h in new:
                evicted.add(h)  # freed and evicted in this one call: never indexed
            else:
                index.remove((h,), self.id)
        fresh = [h for h in reversed(fresh) if h not in evicted]
        if fresh:
            index.insert(fresh, self.id)

    # -- decode rows in aggregate ----------------------------------------------------------------------

    def _join_decode(self, r: SimRequest, step: int) -> None:
        r.join_step = step
        off = r.target - step
        self.n_decode += 1
        self.decode_ctx_offset += off
        self.phase[off % self.bs] += 1
        self.decoding[r.id] = r
        heapq.heappush(self.finish_heap, (step + r.max_tokens - r.generated, r.order, r.epoch, r))

    def _leave_decode(self, r: SimRequest, step: int) -> int:
        """Remove a decode row after `step`; returns its KV length then. Its tokens' times are kept and
        its blocks (grown in aggregate) become its own again, for `_release`."""
        off = r.target - r.join_step
        kv = off + step
        # a row preempted while planning step + 1 already got that step's block, if it needed one
        extra = 1 if self._rows_allocated_for == step + 1 and kv % self.bs == 0 else 0
        r.private_blocks = -(-kv // self.bs) + extra - len(r.shared)
        self.n_decode -= 1
        self.decode_ctx_offset -= off
        self.phase[off % self.bs] -= 1
        del self.decoding[r.id]
        n = step - r.join_step
        if n > 0:
            r.token_times.extend(self.step_times[r.join_step + 1 : step + 1])
            r.generated += n
        return kv

    # -- the step --------------------------------------------------------------------------------------

    def _preempt_one(self, step: int) -> SimRequest | None:
        """Preempt the latest-arrived running sequence (after `step`); it is recomputed later."""
        cands = list(self.decoding.values()) + self.prefilling
        if not cands:
            return None
        victim = max(cands, key=lambda r: r.order)
        if victim.id in self.decoding:
            kv = self._leave_decode(victim, step)
            victim.epoch += 1
        else:
            self.prefilling.remove(victim)
            kv = victim.computed
        self._release(victim, kv)
        victim.target = victim.prompt_tokens + victim.generated
        victim.computed = 0
        self.preemptions += 1
        _insert_in_order(self.waiting, victim)  # back to its place in the queue, as the engine's heap
        self._queue_tokens(victim)
        return victim

    def _plan(self, _: object) -> None:
        if not (self.waiting or self.prefilling):
            # the common steady state: only decode rows, nothing to admit
            step = self.step_no + 1
            rows = self.n_decode
            if not rows:
                self.busy = False
                return
            need = self.phase[(1 - step) % self.bs]
            if not need or self._allocate(need):
                self._rows_allocated_for = step
                self.decode_tokens += rows
                self._step_started = now = self.loop.now
                context = self.decode_ctx_offset + rows * step
                if self.host_contention:
                    dt = self._step_time(0, 0.0, rows, context)
                else:
                    dt = self.perf.step_seconds(0, 0.0, rows, context)
                self.step_ends = now + dt
                self._stepping = True
                self.loop.at(now + dt, self._end_step, None)
                return
        shape = self.shape
        bs = self.bs
        step = self.step_no + 1
        budget = self._step_budget()
        chunk_cap = shape.max_chunk_tokens or budget
        preempted = False
        batch: list[tuple[SimRequest, int]] = []

        # decode rows: one token each; some need a fresh block this step. The engine grants them one
        # by one in arrival order, so the rows ahead of a preemption first take every free and
        # evictable block (evicting the oldest cached), and only then is the last-added preempted
        granted = 0
        while self.n_decode:
            need = self.phase[(1 - step) % bs] - granted
            if self._allocate(need):
                self._rows_allocated_for = step
                break
            ahead = self.available_blocks()
            self._allocate(ahead)
            granted += ahead
            self._preempt_one(step - 1)
            preempted = True
        budget -= self.n_decode

        # prefills in progress
        for r in list(self.prefilling):
            if budget <= 0:
                break
            if r not in self.prefilling:
                continue  # preempted in this loop
            n = min(r.target - r.computed, budget, chunk_cap)
            have = -(-r.computed // bs)
            need = -(-(r.computed + n) // bs) - have
            while not self._allocate(need):
                preempted = True
                rows = self.n_decode
                victim = self._preempt_one(step - 1)
                budget += rows - self.n_decode  # a decode row's token goes back to the budget
                for j, (q, m) in enumerate(batch):
                    if q is victim:  # scheduled earlier in this loop: its tokens go back to the budget
                        del batch[j]
                        budget += m
                        break
                if victim is r or r not in self.prefilling:
                    n = 0
                    break
            if n:
                r.private_blocks += need
                batch.append((r, n))
                budget -= n

        # waiting requests, in arrival order; as in the engine, one whose next uncached block is the
        # block a prefill of this step starts with waits a step (keeping its place) and then takes
        # it from the cache, while the requests behind it go ahead
        if not preempted:
            starting = {
                h for q, _ in batch if q.target - q.computed > 1 and (h := self._next_block(q)) is not None
            }
            deferred: list[SimRequest] = []
            while budget > 0 and self.waiting and self.running < shape.max_num_seqs:
                r = self.waiting[0]
                matched = self._take_prefix(r)
                r.computed = matched * bs
                h = self._next_block(r) if self.caching else None
                if h in starting and r.computed < (r.target - 1) // bs * bs:
                    self._release(r, 0)
                    r.computed = 0
                    deferred.append(self.waiting.popleft())
                    if len(deferred) == MAX_DEFERRED_PER_STEP:
                        break
                    continue
                n = min(r.target - r.computed, budget, chunk_cap)
                need = -(-(r.computed + n) // bs) - matched
                if not self._allocate(need):
                    self._release(r, 0)
                    r.computed = 0
                    break
                self.waiting.popleft()
                self.waiting_tokens -= r.queued_tokens
                if r.cached_tokens < 0:
                    r.cached_tokens = min(r.computed, r.prompt_tokens)
                r.private_blocks = need
                _insert_in_order(self.prefilling, r)
                batch.append((r, n))
                budget -= n
                if h is not None:
                    starting.add(h)
            self.waiting.extendleft(reversed(deferred))

        if not batch and not self.n_decode:
            self.busy = False
            return
        prefill_tokens = 0
        attention = 0.0
        for r, n in batch:
            prefill_tokens += n
            attention += n * (r.computed + n / 2)
        rows = self.n_decode
        dt = self._step_time(prefill_tokens, attention, rows, self.decode_ctx_offset + rows * step)
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += rows
        self._batch = batch
        self._step_started = self.loop.now
        self.step_ends = self.loop.now + dt
        self._stepping = True
        self.loop.at(self.step_ends, self._end_step, None)

    def _step_budget(self) -> int:
        """The engine scheduler's `_step_budget`: `max_num_batched_tokens`, or, where no row is one
        token from its sample, as much of `max_prefill_step_tokens` as the first prefill (the first
        in progress, else the head of the queue) has left, up to `max_chunk_tokens`."""
        budget = self.shape.max_num_batched_tokens
        longest = self.shape.max_prefill_step_tokens or budget
        if longest <= budget or self.n_decode or any(r.target - r.computed <= 1 for r in self.prefilling):
            return budget
        if self.prefilling:
            left = self.prefilling[0].target - self.prefilling[0].computed
        elif self.waiting:
            left = self.waiting[0].target  # recomputed from its start, as the engine counts it
        else:
            return budget
        return min(longest, max(budget, min(left, self.shape.max_chunk_tokens or longest)))

    def _step_time(self, prefill_tokens: int, attention: float, rows: int, context: int) -> float:
        dt = self.perf.step_seconds(prefill_tokens, attention, rows, context)
        if self.host_contention:
            dt *= 1.0 + self.host_contention * sum(1 for w in self.neighbours if w.busy)
        return dt

    def _end_step(self, _: object) -> None:
        self._stepping = False
        now = self.loop.now
        step = self.step_no + 1
        self.step_no = step
        self.step_times.append(now)
        dt = now - self._step_started
        self.busy_s += dt
        self.steps += 1
        if self.n_decode:
            self.last_itl_s = dt
        # the engine applies a step's results in its batch order, which is the order finished
        # sequences are freed in (and so their place in the LRU): decode rows by when they were
        # added, then the step's prefills. (It sorts a prefill's single last token among the rows;
        # the replays against its scheduler found no case where that placement mattered.)
        heap = self.finish_heap
        while heap and heap[0][0] <= step:
            _, _, epoch, r = heapq.heappop(heap)
            if epoch == r.epoch and r.id in self.decoding:
                self._release(r, self._leave_decode(r, step))
                self._finish(r)
        batch = self._batch
        if batch:
            self._batch = []
            self._apply_prefills(batch, now, step)
        inbox, self._inbox = self._inbox, []
        for fn, arg in inbox:
            fn(arg)
        if now >= self._next_sample:
            self.kv_timeline.append((now, self.kv_usage(), self.running))
            self._next_sample = now + self.sample_every_s
        self._plan(None)

    def _apply_prefills(self, batch: list[tuple[SimRequest, int]], now: float, step: int) -> None:
        for r, n in batch:
            r.computed += n
            if self.caching:
                self._publish(r)
            if r.computed < r.target:
                continue
            self.prefilling.remove(r)
            if r.prefill_only:
                # the sampled token travels with the KV; the decode replica delivers it. As the
                # engine's hold, the prompt's full blocks stay taken until the decode leg's pull
                # lands (`unpin_for_peer`): they can be shared, not evicted; the rest is freed now
                self._release(r, r.computed)
                self._pinned[r.id] = self._pin(r.cache_hashes[: r.target // self.bs])
                if self.on_prefilled is not None:
                    self.on_prefilled(r)
                continue
            r.generated += 1
            r.token_times.append(now)
            if r.generated >= r.max_tokens:
                self._release(r, r.computed)
                self._finish(r)
            else:
                self._join_decode(r, step)

    def _finish(self, r: SimRequest) -> None:
        r.done = True
        self.on_finish(r)

    def utilisation(self, duration_s: float) -> float:
        return self.busy_s / duration_s if duration_s > 0 else 0.0

    def mean_kv_usage(self) -> float:
        return sum(u for _, u, _ in self.kv_timeline) / len(self.kv_timeline) if self.kv_timeline else 0.0
