"""The waiting legs' backlog on one prefill worker counts a prefix they share once."""

from __future__ import annotations

from tokenops.cluster.prefill_backlog import PrefillBacklog, leg_blocks
from tokenops.cluster.prefix_index import block_hashes_from_tokens

BLOCK = 16
SYSTEM = list(range(1000, 1512))  # a 512-token system prompt


def _leg(tail: list[int], cached: int = 0):
    ids = SYSTEM + tail
    hashes = tuple(block_hashes_from_tokens(ids, BLOCK))
    return hashes, leg_blocks(hashes, len(ids), cached, BLOCK)


def _two_waiting():
    """A backlog with two legs waiting whose prompts share the system prompt: it, a's hashes, a, b."""
    backlog = PrefillBacklog(BLOCK)
    a_hashes, a = _leg(list(range(64)))
    _, b = _leg(list(range(100, 164)))
    backlog.wait(a)
    backlog.wait(b)
    return backlog, a_hashes, a, b


def test_a_leg_is_its_uncached_blocks_and_its_partial_last_block():
    hashes, leg = _leg(list(range(70)))  # 582 tokens: 36 full blocks and 6 tokens
    assert (leg.blocks, leg.tail) == (hashes, 6)
    _, cached = _leg(list(range(70)), cached=512)
    assert (cached.blocks, cached.tail) == (hashes[32:], 6)
    # no hashes (no prefix index): the whole uncached part is tail, as before
    assert leg_blocks((), 582, 100, BLOCK).tail == 482
    # text blocks standing for more tokens than the prompt has are cut at its uncached tokens
    assert leg_blocks((1, 2, 3), 40, 0, BLOCK).blocks == (1, 2)


def test_two_waiting_legs_with_the_same_prefix_count_it_once():
    backlog, *_ = _two_waiting()
    assert (backlog.legs, backlog.tokens) == (2, 512 + 64 + 64)


def test_legs_with_distinct_prompts_add_up():
    backlog = PrefillBacklog(BLOCK)
    prompts = [list(range(k * 1000, k * 1000 + n)) for k, n in ((1, 300), (2, 517), (3, 64))]
    for ids in prompts:
        backlog.wait(leg_blocks(tuple(block_hashes_from_tokens(ids, BLOCK)), len(ids), 0, BLOCK))
    assert backlog.tokens == 300 + 517 + 64


def test_a_leg_leaving_the_wait_takes_exactly_its_share():
    backlog = PrefillBacklog(BLOCK)
    _, a = _leg(list(range(64)))
    _, b = _leg(list(range(100, 164)))
    _, c = _leg(list(range(200, 205)))  # its own part is a partial block
    for leg in (a, b, c):
        backlog.wait(leg)
    assert backlog.tokens == 512 + 64 + 64 + 5
    backlog.unwait(b)  # withdrawn: its own blocks go, the prefix stays for a and c
    assert (backlog.legs, backlog.tokens) == (2, 512 + 64 + 5)
    backlog.unwait(a)
    backlog.unwait(c)
    assert (backlog.legs, backlog.tokens) == (0, 0)


def test_a_leg_under_way_or_answered_holds_the_prefix_for_the_legs_still_waiting():
    backlog, a_hashes, a, b = _two_waiting()
    backlog.unwait(a)
    backlog.start(a_hashes)  # a is let through: it computes the prefix, b behind it only its tail
    assert (backlog.legs, backlog.tokens) == (1, 64)
    backlog.hold(a_hashes)
    backlog.finish(a_hashes)  # answered: the worker's cache holds the prefix now
    assert backlog.tokens == 64
    backlog.unwait(b)
    _, c = _leg(list(range(300, 364)))
    backlog.wait(c)  # a new wait: the leg is placed with the worker's cache as its index says
    assert backlog.tokens == 512 + 64
    backlog.start(a_hashes)
    backlog.finish(a_hashes)  # a leg under way that failed leaves nothing cached
    assert backlog.tokens == 512 + 64
