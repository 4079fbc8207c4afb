"""The KV block pool: which KV blocks each sequence holds, and the prefix cache over them. `BlockPool`
owns a fixed number of blocks of `block_size` slots, hands them to sequences (`Sequence.block_table`),
counts references, and indexes every *full* computed block by a chained hash (the previous block's
hash and this block's token ids, seeded by the model's identity), so a later sequence with the same
prefix reuses those blocks instead of recomputing them; a hit is trusted only if the stored parent
hash and token ids match too, so a collision degrades to a miss. A block whose last reference goes
away stays reusable until the pool needs the space, then is evicted least recently used first.
Each stored or evicted block is reported as a `KVEvent` in a bounded buffer that the server drains
for routers. The pool holds no tensors (`kv_cache.py` does) and does not decide who runs: the
scheduler asks it whether blocks are available and what to free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tokenops.engine.sequence import Sequence

HashFn = Callable[[int, tuple[int, ...]], int]


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Stable 64-bit hash of a full block given its parent's hash (same value in every process)."""
    h = hashlib.blake2b(parent_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_hash(model_id: str) -> int:
    """The hash the chain starts from: blocks computed by different models never match."""
    return int.from_bytes(hashlib.blake2b(model_id.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq_no: int  # strictly increasing per pool, so a consumer can tell whether it missed events
    kind: str  # "stored" | "evicted"
    block_hash: int
    block_id: int
    parent_hash: int | None = None  # stored only
    token_ids: tuple[int, ...] | None = None  # stored only


class KVEventBuffer:
    """A bounded FIFO of KV events; the oldest are dropped (and counted) when it is full."""

    def __init__(self, capacity: int) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._next = 0
        self.dropped = 0

    def emit(
        self,
        kind: str,
        block_hash: int,
        block_id: int,
        parent_hash: int | None = None,
        token_ids: tuple[int, ...] | None = None,
    ) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(KVEvent(self._next, kind, block_hash, block_id, parent_hash, token_ids))
        self._next += 1

    def drain(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix index
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        model_id: str = "",
        event_capacity: int = 10_000,
        hash_fn: HashFn = chain_hash,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(model_id)
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free but indexed; oldest first
        self._index: dict[int, int] = {}  # block hash -> block id
        self.events = KVEventBuffer(event_capacity)
        # prefix-cache counters, in tokens (vLLM's convention)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.hash_collisions = 0

    # -- capacity -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks are evicted on demand)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks `seq` needs to hold `num_new_tokens` beyond what it has computed."""
        total = seq.num_computed_tokens + num_new_tokens
        held = len(seq.block_table) + seq.kv_gap_len // self.block_size  # evicted blocks count as held
        return max(0, -(-total // self.block_size) - held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # -- allocation ---------------------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence, record: bool = True) -> int:
        """Attach every cached full block of `seq`'s leading tokens; return the tokens reused.

        At most `len - 1` tokens are reused (rounded down to a block), so the last token is always
        computed: its logits are needed to sample the next token. `record=False` leaves the hit/query
        counters to the caller (the scheduler counts a request once, when it is admitted).
        """
        assert not seq.block_table, "allocate_prefix on a sequence that already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        tokens = seq.token_ids
        parent = self.root_hash
        reused = 0
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent, chunk)
            bid = self._index.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.token_ids != chunk or block.parent_hash != parent:
                self.hash_collisions += 1
                break
            self._acquire(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent = h
            reused += bs
        seq.num_computed_tokens = reused
        if record:
            self.record_query(len(tokens), reused)
        return reused

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks it needs for its next `num_new_tokens`; the caller checked room."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            bid = self._take_free_block()
            self.blocks[bid].ref_count = 1
            seq.block_table.append(bid)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks of `seq` that became full and computed since the last call.

        Not after a KV eviction: those blocks were computed over an incomplete history."""
        if not self.enable_prefix_caching or seq.kv_gap_len:
            return
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root_hash
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h in self._index:
                # the same content is already indexed (another sequence computed it at the same
                # time), or a different content collides: keep the indexed block, leave this one out
                if self._index[h] != block.block_id:
                    other = self.blocks[self._index[h]]
                    if other.token_ids != chunk or other.parent_hash != parent:
                        self.hash_collisions += 1
                continue
            block.block_hash, block.parent_hash, block.token_ids = h, parent, chunk
            self._index[h] = block.block_id
            self.events.emit("stored", h, block.block_id, parent, chunk)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks beyond those that hold its first `num_tokens` tokens (the slots
        of rejected speculative tokens). Such tail blocks are never in the prefix index."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.block_hash is None, "trimming an indexed block"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_plain.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; indexed blocks stay reusable, tail blocks become LRU-oldest."""
        self._release(reversed(seq.block_table))
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.kv_gap_start = seq.kv_gap_len = 0

    def drop_blocks(self, seq: Sequence, start: int, count: int) -> None:
        """Release `seq.block_table[start:start + count]` (KV eviction); the table closes the gap."""
        self._release(seq.block_table[start : start + count])
        del seq.block_table[start : start + count]

    def reset_prefix_cache(self) -> None:
        """Forget every free indexed block (blocks in use keep their index entries)."""
        while self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(bid)
            self._free_plain.append(bid)

    # -- internals ----------------------------------------------------------------------------

    def _release(self, block_ids: Iterable[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed more often than allocated"
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_plain.append(bid)

    def _acquire(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free_cached[bid]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_plain:
            return self._free_plain.popleft()
        bid, _ = self._free_cached.popitem(last=False)  # least recently freed
        self._evict(bid)
        return bid

    def _evict(self, bid: int) -> None:
        block = self.blocks[bid]
        assert block.block_hash is not None
        del self._index[block.block_hash]
        self.events.emit("evicted", block.block_hash, bid)
        block.block_hash = block.parent_hash = block.token_ids = None

    # -- KV transfer (engine/kv_transfer.py) ---------------------------------------------------

    def prefix_hashes(self, token_ids: Seq[int]) -> list[int]:
        """The chained hashes of every full block of `token_ids` (what another engine's pool would
        index them under: the hash depends only on the model id and the tokens)."""
        bs = self.block_size
        parent, out = self.root_hash, []
        for i in range(len(token_ids) // bs):
            parent = self.hash_fn(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out

    def cached_blocks(self, hashes: Seq[int]) -> int:
        """How many leading blocks of `hashes` the index holds now."""
        n = 0
        while n < len(hashes) and hashes[n] in self._index:
            n += 1
        return n

    def pin_cached(self, hashes: Seq[int]) -> list[int]:
        """Take a reference on the indexed blocks of `hashes`, in order, up to the first one not held;
        return their ids. Pinned blocks are neither evicted nor rewritten until `unpin`."""
        pinned = []
        for h in hashes:
            bid = self._index.get(h)
            if bid is None:
                break
            self._acquire(bid)
            pinned.append(bid)
        return pinned

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Drop the references `pin_cached` took; as `free`, tail first, so a pinned prefix's head
        becomes the LRU-newest and eviction trims it from its end."""
        self._release(reversed(list(block_ids)))

    def import_block(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Index a free block under `block_hash` for KV that the caller writes into it next, and
        return its id (None when the hash is indexed already or no block is free). The block stays
        free and cached, so the next request with this prefix attaches it like any cached block."""
        if not self.enable_prefix_caching or block_hash in self._index or not self.num_free_blocks:
            return None
        bid = self._take_free_block()
        block = self.blocks[bid]
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._index[block_hash] = bid
        self._free_cached[bid] = None  # newest: evicted last
        self.events.emit("stored", block_hash, bid, parent_hash, token_ids)
        return bid

    def import_chain(self, token_ids: Seq[int], start_block: int, hashes: Seq[int]) -> list[tuple[int, int]]:
        """Index free blocks for a peer's full blocks `start_block`, `start_block + 1`, ... of
        `token_ids` (their hashes `hashes`); return (block id, i) for each block whose bytes the
        caller writes next (hashes[i]'s). Stops at the first hash these tokens do not give, or when
        no block is left but the chain's own. The chain is pinned while it is placed: the local
        prefix it extends and each block already in place, so making room never evicts its own head
        (which would strand the rest); then unpinned tail first, as `free` does, so eviction trims
        it from its end."""
        expected = self.prefix_hashes(token_ids)
        bs = self.block_size
        pinned = self.pin_cached(expected[:start_block])
        placed: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            at = start_block + i
            if at >= len(expected) or expected[at] != h:
                break
            parent = expected[at - 1] if at else self.root_hash
            chunk = tuple(token_ids[at * bs : (at + 1) * bs])
            bid = self.import_block(h, parent, chunk)
            if bid is not None:
                placed.append((bid, i))
            else:
                bid = self._index.get(h)
                block = self.blocks[bid] if bid is not None else None
                if block is None or block.token_ids != chunk or block.parent_hash != parent:
                    break  # no room left but the chain's own, or another block under this hash
                # cached here already (even if its head is not)
            self._acquire(bid)
            pinned.append(bid)
        self.unpin(pinned)
        return placed

    def lookup(self, token_ids: Seq[int]) -> int:
        """Tokens of `token_ids` a new request would find cached now (no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent = self.root_hash
        hit = 0
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent, chunk)
            bid = self._index.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk or self.blocks[bid].parent_hash != parent:
                break
            parent = h
            hit += bs
        return hit

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests)."""
        free = set(self._free_plain) | set(self._free_cached)
        assert len(free) == len(self._free_plain) + len(self._free_cached), "block listed free twice"
        for b in self.blocks:
            assert b.ref_count >= 0
            assert (b.ref_count == 0) == (b.block_id in free), f"block {b.block_id} ref/free mismatch"
            if b.block_id in self._free_cached:
                assert b.block_hash is not None
            if b.block_hash is not None:
                assert self._index.get(b.block_hash) == b.block_id
        assert len(self._index) == sum(b.block_hash is not None for b in self.blocks)
