"""The block pool and prefix cache, without a model: reuse, ref counts, LRU eviction, collisions, events."""

from __future__ import annotations

from tokenops.engine.block_pool import BlockPool, chain_hash
from tokenops.engine.sequence import Sequence


def admit(pool: BlockPool, seq: Sequence) -> int:
    """What the scheduler does for a new sequence: reuse the cached prefix, allocate the rest."""
    cached = pool.allocate_prefix(seq)
    pool.allocate(seq, seq.num_uncomputed_tokens)
    return cached


def compute(pool: BlockPool, seq: Sequence) -> None:
    """Pretend the model computed every token the sequence holds."""
    seq.num_computed_tokens = len(seq.token_ids)
    pool.cache_full_blocks(seq)


def test_full_blocks_are_reused_and_partial_blocks_are_not():
    pool = BlockPool(16, 4)
    a = Sequence("a", list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    assert admit(pool, a) == 0
    compute(pool, a)
    assert pool.num_cached_blocks == 2  # the partial third block is never indexed
    b = Sequence("b", list(range(10)) + [99])
    assert admit(pool, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert pool.blocks[a.block_table[0]].ref_count == 2
    assert pool.prefix_hits == 8 and pool.prefix_queries == 10 + 11
    pool.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_token():
    pool = BlockPool(16, 4)
    a = Sequence("a", list(range(8)))
    admit(pool, a)
    compute(pool, a)
    assert pool.num_cached_blocks == 2
    b = Sequence("b", list(range(8)))
    # both blocks are cached, but reuse stops at len-1 rounded down to a block: one block
    assert admit(pool, b) == 4
    assert b.num_uncomputed_tokens == 4
    c = Sequence("c", list(range(9)))
    assert admit(pool, c) == 8 and c.num_uncomputed_tokens == 1


def test_refcounts_return_to_zero_and_every_block_is_free():
    pool = BlockPool(8, 4)
    seqs = [Sequence(str(i), [1, 2, 3, 4, 5, 6, 7, 8, i]) for i in range(3)]
    for s in seqs:
        admit(pool, s)
        compute(pool, s)
    assert pool.num_used_blocks == 2 + 3
    for s in seqs:
        pool.free(s)
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_cached_blocks == 2  # still reusable
    pool.check_invariants()


def test_lru_eviction_order_and_events():
    pool = BlockPool(4, 2)
    a, b = Sequence("a", [1, 2, 3]), Sequence("b", [7, 8, 9])
    for s in (a, b):
        admit(pool, s)
        compute(pool, s)
    ha, hb = a.block_hashes[0], b.block_hashes[0]
    pool.free(a)  # a's block becomes the least recently freed
    pool.free(b)
    pool.events.drain()
    # 4 blocks: 2 plain free first, then the cached ones oldest first
    c = Sequence("c", [20, 21, 22, 23, 24, 25, 26])
    admit(pool, c)
    events = pool.events.drain()
    assert [(e.kind, e.block_hash) for e in events] == [("evicted", ha), ("evicted", hb)]
    assert pool.lookup([1, 2, 3]) == 0 and pool.lookup([7, 8, 9]) == 0
    pool.check_invariants()


def test_a_freed_or_unpinned_prefix_is_evicted_from_its_end():
    # a 4-block prompt cached and free, then pinned and unpinned (a peer's pull of it); an unrelated
    # prompt then needs two of its blocks: its last two go, its first two stay reachable
    pool = BlockPool(6, 2)
    a = Sequence("a", list(range(8)) + [99])
    admit(pool, a)
    compute(pool, a)
    hashes = list(a.block_hashes)
    pool.free(a)
    assert pool.cached_blocks(hashes) == 4
    pool.unpin(pool.pin_cached(hashes))
    b = Sequence("b", [50 + i for i in range(7)])  # 4 blocks: 2 plain free, then 2 of a's
    admit(pool, b)
    assert pool.cached_blocks(hashes) == 2
    assert pool.lookup(list(range(8)) + [99]) == 4
    pool.check_invariants()


def test_reuse_refreshes_lru_position():
    pool = BlockPool(4, 2)
    a, b = Sequence("a", [1, 2, 3]), Sequence("b", [7, 8, 9])
    for s in (a, b):
        admit(pool, s)
        compute(pool, s)
        pool.free(s)
    a2 = Sequence("a2", [1, 2, 5])  # touches a's block again
    assert admit(pool, a2) == 2
    compute(pool, a2)
    pool.free(a2)
    d = Sequence("d", [40, 41, 42, 43, 44])  # 3 blocks: evicts b's block before a's
    admit(pool, d)
    assert pool.lookup([7, 8, 9]) == 0
    assert pool.lookup([1, 2, 3]) == 2
    pool.check_invariants()


def test_stored_events_carry_the_chain():
    pool = BlockPool(8, 2, model_id="m")
    a = Sequence("a", [1, 2, 3, 4, 5])
    admit(pool, a)
    compute(pool, a)
    stored = pool.events.drain()
    assert [e.kind for e in stored] == ["stored", "stored"]
    assert stored[0].parent_hash == pool.root_hash
    assert stored[1].parent_hash == stored[0].block_hash
    assert stored[1].block_hash == chain_hash(stored[0].block_hash, (3, 4))
    assert stored[0].seq_no < stored[1].seq_no


def test_model_identity_seeds_the_hash():
    assert BlockPool(2, 2, model_id="x").root_hash != BlockPool(2, 2, model_id="y").root_hash


def test_forced_hash_collision_is_detected():
    pool = BlockPool(8, 2, hash_fn=lambda parent, tokens: 42)  # every block hashes the same
    a = Sequence("a", [1, 2, 3])
    admit(pool, a)
    compute(pool, a)
    b = Sequence("b", [5, 6, 7])
    assert admit(pool, b) == 0  # same hash, different tokens: a miss, not a wrong reuse
    assert pool.hash_collisions == 1
    assert b.block_table[0] != a.block_table[0]
    compute(pool, b)  # indexing b's block collides too and is left out
    assert pool.hash_collisions == 2
    pool.check_invariants()


def test_event_buffer_is_bounded():
    pool = BlockPool(64, 1, event_capacity=5)
    s = Sequence("s", list(range(20)))
    admit(pool, s)
    compute(pool, s)
    assert len(pool.events) == 5 and pool.events.dropped == 15
    assert [e.seq_no for e in pool.events.drain()] == [15, 16, 17, 18, 19]


def test_prefix_caching_disabled():
    pool = BlockPool(8, 2, enable_prefix_caching=False)
    a = Sequence("a", [1, 2, 3])
    admit(pool, a)
    compute(pool, a)
    assert pool.num_cached_blocks == 0
    b = Sequence("b", [1, 2, 3])
    assert admit(pool, b) == 0
