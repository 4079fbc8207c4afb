"""Which replica holds which prompt prefix: chained block hashes in a memory-bounded LRU index.

A prompt is cut into fixed-size blocks (token ids when the gateway has them, characters of the rendered
text otherwise) and each block's hash is chained with the previous one, so one hash names the whole
prefix up to that block; matching is a walk from the first block. The index stores (block hash,
replica) pairs in one LRU of bounded size: memory never grows past `max_entries`, unlike an unbounded
trie (vLLM production-stack issue #687). It is approximate by default (fed by routing decisions) and
can be made exact from an engine's KV events (`KVEventApplier`). It does not route; policies read it.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT_HASH = 0


def _chain(parent: int, payload: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little") + payload, digest_size=8)
    return int.from_bytes(h.digest(), "little")


def block_hashes_from_tokens(
    token_ids: Sequence[int], block_size: int = 16, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of the prompt's full token blocks (a trailing partial block is not cacheable)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(parent, struct.pack(f"<{block_size}q", *token_ids[start : start + block_size]))
        out.append(parent)
    return out


def block_hashes_from_text(text: str, block_chars: int = 64) -> list[int]:
    """Chained hashes of the prompt text in blocks of `block_chars` characters.

    Used when the gateway does not tokenize: the boundaries differ from the engine's token blocks, but
    two prompts sharing a long text prefix share the same leading text hashes, which is all a router
    needs. Roughly four characters per token, so the default block stands for ~16 tokens.
    """
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = _chain(parent, text[start : start + block_chars].encode("utf-8"))
        out.append(parent)
    return out


class PrefixIndex:
    """Bounded LRU map of block hash -> replicas holding that block.

    Each (hash, replica) pair is one entry; touching a prefix refreshes its entries, and inserting past
    `max_entries` evicts the least recently used pair. Lookups are O(blocks in the prompt). The
    replicas holding a block are a bit mask (one bit per replica name; `remove_replica` frees the
    bit for the next replica the index meets): a match is an AND per block, and an entry is not a set
    the garbage collector has to walk.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._holders: dict[int, int] = {}  # block hash -> mask of the replicas holding it
        self._bits: dict[str, int] = {}  # replica -> its bit
        self._names: dict[int, str] = {}  # bit position -> replica
        self._free: list[int] = []  # positions freed by `remove_replica` (a heap: lowest reused first)

    def __len__(self) -> int:
        return len(self._lru)

    def _bit(self, replica: str) -> int:
        bit = self._bits.get(replica)
        if bit is None:
            pos = heapq.heappop(self._free) if self._free else len(self._names)
            bit = self._bits[replica] = 1 << pos
            self._names[pos] = replica
        return bit

    def match(self, hashes: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, int]:
        """Number of leading blocks of `hashes` each replica holds (replicas with no match are omitted)."""
        matched: dict[str, int] = {}
        holders = self._holders
        alive = holders.get(hashes[0], 0) if hashes else 0  # replicas whose match is still unbroken
        if alive and replicas is not None:
            bits = self._bits
            allowed = 0
            for rid in replicas:
                allowed |= bits.get(rid, 0)
            alive &= allowed
        if not alive:
            return matched
        n = len(hashes)
        for i in range(1, n):
            still = alive & holders.get(hashes[i], 0)
            if still != alive:
                self._record(alive & ~still, i, matched)
                alive = still
                if not alive:
                    return matched
        self._record(alive, n, matched)
        return matched

    def holders(self, block_hash: int) -> set[str]:
        """The replicas holding one block."""
        found: dict[str, int] = {}
        self._record(self._holders.get(block_hash, 0), 0, found)
        return set(found)

    def _record(self, mask: int, blocks: int, matched: dict[str, int]) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            matched[names[low.bit_length() - 1]] = blocks
            mask ^= low

    def insert(self, hashes: Iterable[int], replica: str) -> None:
        lru, holders, limit = self._lru, self._holders, self.max_entries
        bit = self._bit(replica)
        for h in hashes:
            key = (h, replica)
            size = len(lru)
            lru[key] = None  # a known pair keeps its place here: one lookup either way
            if len(lru) == size:
                lru.move_to_end(key)
                continue
            holders[h] = holders.get(h, 0) | bit
            if len(lru) > limit:
                (old, owner), _ = lru.popitem(last=False)
                self._drop_holder(old, owner)

    def remove(self, hashes: Iterable[int], replica: str) -> None:
        for h in hashes:
            if (h, replica) in self._lru:
                del self._lru[(h, replica)]
                self._drop_holder(h, replica)

    def remove_replica(self, replica: str) -> None:
        """Forget everything a replica held (it restarted, so its KV cache is empty, or it left) and
        free its bit."""
        if replica not in self._bits:
            return
        for key in [k for k in self._lru if k[1] == replica]:
            del self._lru[key]
            self._drop_holder(key[0], replica)
        pos = self._bits.pop(replica).bit_length() - 1
        del self._names[pos]
        heapq.heappush(self._free, pos)

    def _drop_holder(self, h: int, replica: str) -> None:
        mask = self._holders.get(h)
        if mask is not None:
            mask &= ~self._bits[replica]
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]


# ---------------------------------------------------------------------------------------------
# KV events: the engine tells us what it stored and evicted, so the index becomes exact.
# The names follow vLLM's KV event stream (BlockStored, BlockRemoved, AllBlocksCleared).


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]  # the engine's own hashes, one per stored block
    parent_block_hash: int | None  # the engine's hash of the block before the first one, None at the root
    token_ids: tuple[int, ...]  # all tokens of the stored blocks, len == block_size * len(block_hashes)
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventApplier:
    """Translate one replica's KV events into our hash space and apply them to a `PrefixIndex`.

    The engine's block hashes need not match ours (another hash function, a per-model root): the event
    carries the token ids, so we recompute our chained hash and keep a map engine-hash -> our-hash to
    continue chains and to honour removals. A parent we never saw stored is the engine's root while we
    have seen the stream from its start (`complete`, kept by the caller); otherwise only known roots
    count (learnt earlier, or given: our engine can report its root in `/v1/load` as `kv_root_hash`),
    and blocks under an unknown parent are skipped rather than mis-indexed.
    """

    def __init__(self, index: PrefixIndex, replica: str, roots: Iterable[int] = ()) -> None:
        self.index = index
        self.replica = replica
        self.roots: set[int] = set(roots)
        self.complete = True
        self._ours: dict[int, int] = {}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            parent = ROOT_HASH
            if event.parent_block_hash is not None and event.parent_block_hash not in self.roots:
                known = self._ours.get(event.parent_block_hash)
                if known is not None:
                    parent = known
                elif self.complete:
                    self.roots.add(event.parent_block_hash)
                else:
                    return  # parent unknown (its event was lost): the chain cannot be named
            ours = block_hashes_from_tokens(event.token_ids, event.block_size, parent)
            for theirs, mine in zip(event.block_hashes, ours, strict=False):
                self._ours[theirs] = mine
            self.index.insert(ours, self.replica)
        elif isinstance(event, BlockRemoved):
            mine = [self._ours.pop(h) for h in event.block_hashes if h in self._ours]
            self.index.remove(mine, self.replica)
        else:
            self._ours.clear()
            self.index.remove_replica(self.replica)

    def resync(self) -> None:
        """Events were lost or the engine restarted: forget this replica's blocks (we cannot know which
        were evicted). The caller sets `complete` according to where the event stream resumes."""
        self.apply(AllBlocksCleared())
