"""The prefix index: chained hashes, longest-match lookup, the memory bound, and exact KV events."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenops.cluster.prefix_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventApplier,
    PrefixIndex,
    block_hashes_from_text,
    block_hashes_from_tokens,
)


def test_chained_hashes_name_the_whole_prefix() -> None:
    a = block_hashes_from_tokens(list(range(64)), 16)
    b = block_hashes_from_tokens(list(range(32)) + [999] + list(range(33, 64)), 16)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # a change breaks the rest
    assert len(block_hashes_from_tokens(list(range(31)), 16)) == 1  # partial block dropped
    assert block_hashes_from_text("x" * 200, 64) == block_hashes_from_text("x" * 255, 64)[:3]


def test_match_counts_leading_blocks_per_replica() -> None:
    idx = PrefixIndex()
    h = block_hashes_from_tokens(list(range(160)), 16)
    idx.insert(h[:3], "a")
    idx.insert(h, "b")
    idx.insert(h[1:], "c")  # holds later blocks but not the first: no usable prefix
    assert idx.match(h) == {"a": 3, "b": 10}
    assert idx.match(h, replicas=["a", "c"]) == {"a": 3}
    assert idx.match([]) == {}


def test_index_stays_within_its_memory_bound_on_a_long_random_workload() -> None:
    rng = random.Random(0)
    idx = PrefixIndex(max_entries=2_000)
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(16, 400))] for _ in range(30)]
    for i in range(3_000):
        toks = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(0, 300))]
        idx.insert(block_hashes_from_tokens(toks, 16), f"r{rng.randrange(8)}")
        if i % 1000 == 0:
            assert len(idx) <= 2_000
    assert len(idx) == 2_000
    # the holder map never keeps more pairs than the LRU (no leak on eviction)
    assert sum(len(idx.holders(h)) for h in idx._holders) == len(idx)
    # recently used, popular prefixes survived eviction
    sys_hashes = block_hashes_from_tokens(systems[0], 16)
    idx.insert(sys_hashes, "r0")
    assert idx.match(sys_hashes)["r0"] == len(sys_hashes)


def test_lru_evicts_the_least_recently_used() -> None:
    idx = PrefixIndex(max_entries=4)
    idx.insert([1, 2], "a")
    idx.insert([3, 4], "b")
    idx.insert([1], "a")  # touch
    idx.insert([5], "c")  # evicts (2, a), the oldest untouched
    assert idx.match([1, 2]) == {"a": 1}
    assert idx.match([3, 4]) == {"b": 2}


def test_a_forgotten_replica_gives_its_bit_back() -> None:
    idx = PrefixIndex()
    idx.insert([1, 2], "stays")
    for i in range(200):  # replicas come and go (restarts under new names, scale-in)
        idx.insert([100 + i, 1], f"gone{i}")
        idx.remove_replica(f"gone{i}")
    assert len(idx) == 2 and idx.holders(1) == {"stays"} and idx.holders(100) == set()
    # every mask still fits in two bits: the 200 replicas that left reused one position
    assert max(idx._holders.values()).bit_length() <= 2
    idx.insert([1], "new")
    assert idx.match([1, 2]) == {"stays": 2, "new": 1}
    idx.remove_replica("never-seen")  # forgetting an unknown replica is a no-op
    assert len(idx) == 3


def test_kv_events_make_the_index_exact_in_our_hash_space() -> None:
    idx = PrefixIndex()
    ev = KVEventApplier(idx, "r0")
    toks = list(range(48))
    # the engine uses its own hash numbers; we recompute ours from the tokens
    ev.apply(
        BlockStored(
            block_hashes=(901, 902), parent_block_hash=None, token_ids=tuple(toks[:32]), block_size=16
        )
    )
    ev.apply(
        BlockStored(block_hashes=(903,), parent_block_hash=902, token_ids=tuple(toks[32:]), block_size=16)
    )
    ours = block_hashes_from_tokens(toks, 16)
    assert idx.match(ours) == {"r0": 3}
    ev.apply(BlockRemoved(block_hashes=(903,)))
    assert idx.match(ours) == {"r0": 2}
    # a block whose parent we never saw cannot be named: ignored, not mis-indexed
    ev.apply(
        BlockStored(block_hashes=(999,), parent_block_hash=12345, token_ids=tuple(range(16)), block_size=16)
    )
    assert len(idx) == 2
    ev.apply(AllBlocksCleared())
    assert idx.match(ours) == {} and len(idx) == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["ins", "rm", "drop"]),
            st.lists(st.integers(0, 30), max_size=6),
            st.integers(0, 3),
        ),
        max_size=80,
    ),
    st.integers(1, 12),
)
def test_index_invariants_hold_under_any_sequence(ops: list, bound: int) -> None:
    idx = PrefixIndex(max_entries=bound)
    for op, hashes, rep in ops:
        replica = f"r{rep}"
        if op == "ins":
            idx.insert(hashes, replica)
        elif op == "rm":
            idx.remove(hashes, replica)
        else:
            idx.remove_replica(replica)
        assert len(idx) <= bound
        pairs = {(h, r) for h in idx._holders for r in idx.holders(h)}
        assert pairs == set(idx._lru)  # the two maps never drift apart
        assert all(idx._holders.values())  # no empty holder masks left behind
