"""Each balancing policy as a pure function over constructed snapshots (no I/O, no event loop)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenops.cluster.policies import (
    KVAwareCost,
    LeastOutstanding,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    SessionAffinity,
    _h64,
    _rendezvous,
    make_policy,
)
from tokenops.cluster.prefix_index import block_hashes_from_text, block_hashes_from_tokens
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, ReportedLoad, RequestInfo


def pool(*loads: int, weights: tuple[float, ...] | None = None, **kw: object) -> PoolSnapshot:
    weights = weights or (1.0,) * len(loads)
    reps = tuple(
        ReplicaState(id=f"r{i}", in_flight=n, weight=w)
        for i, (n, w) in enumerate(zip(loads, weights, strict=True))
    )
    return PoolSnapshot(reps, now=100.0, **kw)  # type: ignore[arg-type]


def req(text: str = "", session: str | None = None, **kw: object) -> RequestInfo:
    hashes = tuple(block_hashes_from_text(text)) if text else ()
    return RequestInfo(model="m", session_id=session, block_hashes=hashes, prompt_tokens=len(text) // 4, **kw)  # type: ignore[arg-type]


def test_round_robin_cycles_and_respects_weight() -> None:
    rr = RoundRobin()
    p = pool(0, 0, 0)
    assert [rr.choose(req(), p).replica for _ in range(6)] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    rr = RoundRobin()
    p = pool(0, 0, weights=(3.0, 1.0))
    picks = Counter(rr.choose(req(), p).replica for _ in range(400))
    assert picks == {"r0": 300, "r1": 100}


def test_least_outstanding_picks_min_and_uses_reported_load() -> None:
    lo = LeastOutstanding()
    assert lo.choose(req(), pool(5, 2, 7)).replica == "r1"
    # r1 looks idle to this gateway but reports 9 running: the larger view wins
    reps = (
        ReplicaState("r0", in_flight=3),
        ReplicaState("r1", in_flight=0, polled=True, reported=ReportedLoad(running=9, read_at=99.0)),
    )
    assert lo.choose(req(), PoolSnapshot(reps, now=100.0)).replica == "r0"
    # weight 2 halves the per-weight load
    assert lo.choose(req(), pool(4, 3, weights=(2.0, 1.0))).replica == "r0"


def test_stale_report_is_treated_as_saturated() -> None:
    reps = (
        ReplicaState("fresh", in_flight=6, polled=True, reported=ReportedLoad(running=6, read_at=99.0)),
        ReplicaState("stale", in_flight=0, polled=True, reported=ReportedLoad(running=0, read_at=10.0)),
        ReplicaState("never", in_flight=0, polled=True, reported=None),
    )
    snap = PoolSnapshot(reps, now=100.0, stale_after=5.0)
    assert snap.is_saturated(reps[1]) and snap.is_saturated(reps[2]) and not snap.is_saturated(reps[0])
    for policy in (LeastOutstanding(), PowerOfTwo(seed=1), PrefixAware(), KVAwareCost(), RoundRobin()):
        assert {policy.choose(req("x" * 300), snap).replica for _ in range(20)} == {"fresh"}, policy.name


def test_power_of_two_never_picks_the_worst() -> None:
    p2c = PowerOfTwo(seed=7)
    snap = pool(1, 2, 3, 50)
    picks = Counter(p2c.choose(req(), snap).replica for _ in range(300))
    assert picks["r3"] == 0  # the most loaded never wins a pair
    assert picks["r0"] > picks["r2"]


def test_session_affinity_sticks_while_within_bounds_and_spills_when_over() -> None:
    sa = SessionAffinity(epsilon=0.25)
    snap = pool(4, 4, 4, 4)
    home = sa.choose(req(session="conv-42"), snap).replica
    assert all(sa.choose(req(session="conv-42"), snap).replica == home for _ in range(20))
    # sessions spread across replicas
    homes = Counter(sa.choose(req(session=f"s{i}"), snap).replica for i in range(400))
    assert len(homes) == 4 and min(homes.values()) > 40
    # the home replica runs over (1 + eps) x its share: the session moves...
    loads = [4, 4, 4, 4]
    loads[int(home[1:])] = 12
    d = sa.choose(req(session="conv-42"), pool(*loads))
    assert d.replica != home and d.reason == "session-spill"
    # ...and comes back home once its load is within bounds again
    loads[int(home[1:])] = 5
    assert sa.choose(req(session="conv-42"), pool(*loads)).replica == home


def test_session_affinity_survives_a_replica_leaving() -> None:
    sa = SessionAffinity()
    full = pool(0, 0, 0, 0)
    homes = {f"s{i}": sa.choose(req(session=f"s{i}"), full).replica for i in range(200)}
    gone = "r2"
    rest = PoolSnapshot(tuple(r for r in full.replicas if r.id != gone), now=100.0)
    moved = [s for s, h in homes.items() if h != gone and sa.choose(req(session=s), rest).replica != h]
    assert moved == []  # only the sessions of the lost replica move


def test_session_affinity_without_session_uses_fallback() -> None:
    assert SessionAffinity().choose(req(), pool(3, 1)).replica == "r1"


SYSTEM = "You are a helpful assistant for ACME. " * 20


def test_prefix_aware_sends_shared_system_prompt_to_its_holder_and_spreads_misses() -> None:
    pa = PrefixAware(balance_abs=8, balance_rel=1.5)
    snap = pool(0, 0, 0, 0)
    first = pa.choose(req(SYSTEM + "user: hi"), snap)
    assert first.reason == "prefix-miss least-loaded"
    for i in range(10):
        d = pa.choose(req(SYSTEM + f"user: question {i}"), snap)
        assert d.replica == first.replica and d.reason.startswith("prefix-hit")
        assert d.matched_blocks >= len(block_hashes_from_text(SYSTEM))
    # unrelated prompts (misses) at equal load spread over the pool rather than piling onto one replica
    misses = Counter(pa.choose(req(f"{i} unrelated " * 30), snap).replica for i in range(200))
    assert len(misses) == 4 and max(misses.values()) < 90


def test_prefix_aware_does_not_pile_prompts_sharing_only_a_generic_header() -> None:
    pa = PrefixAware()
    header = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    header = header + " " * (128 - len(header))  # exactly two 64-character blocks
    snap = pool(0, 0, 0, 0)
    picks = Counter(pa.choose(req(header + f"question {i} " * 40), snap).replica for i in range(200))
    assert len(picks) == 4 and max(picks.values()) < 90  # 2 shared blocks of ~30 is not locality


def test_prefix_aware_longest_match_wins() -> None:
    pa = PrefixAware()
    a = SYSTEM + "conversation A turn 1 " * 10
    pa.index.insert(block_hashes_from_text(SYSTEM), "r0")
    pa.index.insert(block_hashes_from_text(a), "r1")
    d = pa.choose(req(a + "turn 2"), pool(0, 0, 0))
    assert d.replica == "r1"


def test_prefix_aware_falls_back_to_least_loaded_when_imbalanced() -> None:
    pa = PrefixAware(balance_abs=4, balance_rel=1.5)
    pa.index.insert(block_hashes_from_text(SYSTEM), "r0")
    # within thresholds: the holder wins even though it is busier
    assert pa.choose(req(SYSTEM + "q"), pool(4, 1, 2)).replica == "r0"
    # beyond both the absolute and the relative threshold: least loaded wins
    d = pa.choose(req(SYSTEM + "q"), pool(10, 1, 2))
    assert d.replica == "r1" and d.reason.startswith("imbalanced")
    # (that decision taught the index that r1 now holds the prompt too)
    assert set(pa.index.match(block_hashes_from_text(SYSTEM))) == {"r0", "r1"}
    # a big relative gap but a small absolute one is not imbalance
    pa = PrefixAware(balance_abs=4, balance_rel=1.5)
    pa.index.insert(block_hashes_from_text(SYSTEM), "r0")
    assert pa.choose(req(SYSTEM + "q2"), pool(3, 0, 0)).replica == "r0"


def test_kv_aware_cost_trades_cache_hits_against_backlog() -> None:
    kv = KVAwareCost(backlog_weight=1.0, decode_weight=0.5, learn=False)
    toks = list(range(1000))
    hashes = tuple(block_hashes_from_tokens(toks, 16))
    kv.index.insert(hashes, "r0")
    r = RequestInfo(model="m", block_hashes=hashes, block_tokens=16, prompt_tokens=1000, max_tokens=100)
    idle = (ReplicaState("r0"), ReplicaState("r1"))
    assert kv.choose(r, PoolSnapshot(idle, now=1.0)).replica == "r0"  # 8 uncached vs 1000
    busy = (
        ReplicaState("r0", in_flight=4, in_flight_prompt_tokens=4000, in_flight_output_tokens=800),
        ReplicaState("r1"),
    )
    assert kv.choose(r, PoolSnapshot(busy, now=1.0)).replica == "r1"  # 8 + 4400 vs 1000
    light = (
        ReplicaState("r0", in_flight=1, in_flight_prompt_tokens=300, in_flight_output_tokens=100),
        ReplicaState("r1"),
    )
    assert kv.choose(r, PoolSnapshot(light, now=1.0)).replica == "r0"  # 8 + 350 vs 1000


def test_kv_aware_counts_other_gateways_load_from_reports() -> None:
    kv = KVAwareCost()
    r = RequestInfo(model="m", prompt_tokens=100, max_tokens=100)
    reps = (
        ReplicaState("r0", polled=True, reported=ReportedLoad(running=5, read_at=1.0)),
        ReplicaState("r1", polled=True, reported=ReportedLoad(running=0, read_at=1.0)),
    )
    assert kv.choose(r, PoolSnapshot(reps, now=1.0)).replica == "r1"


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("prefix_aware", balance_abs=3), PrefixAware)
    with pytest.raises(ValueError, match="unknown balancing policy"):
        make_policy("random_walk")


def test_policies_are_deterministic_given_the_same_inputs() -> None:
    # the simulator replays decisions: same inputs and seed, same choices
    rng = random.Random(3)
    prompts = [SYSTEM[: rng.randint(0, len(SYSTEM))] + str(rng.random()) * 8 for _ in range(50)]
    for make in (
        lambda: PrefixAware(),
        lambda: PowerOfTwo(seed=5),
        lambda: SessionAffinity(),
        lambda: KVAwareCost(),
    ):
        a, b = make(), make()
        snap = pool(1, 2, 3)
        assert [a.choose(req(p, session=p[-5:]), snap) for p in prompts] == [
            b.choose(req(p, session=p[-5:]), snap) for p in prompts
        ]


def test_when_every_replica_is_saturated_load_still_decides() -> None:
    reps = tuple(
        ReplicaState(f"r{i}", in_flight=n, polled=True, reported=None) for i, n in enumerate((5, 1, 3))
    )
    snap = PoolSnapshot(reps, now=100.0)
    assert all(snap.is_saturated(r) for r in reps)
    for policy in (LeastOutstanding(), PrefixAware(), KVAwareCost(), SessionAffinity()):
        assert policy.choose(req("y" * 200, session="s"), snap).replica == "r1", policy.name


def test_least_outstanding_rotates_ties_even_for_identical_prompts() -> None:
    lo = LeastOutstanding()
    picks = Counter(lo.choose(req(SYSTEM), pool(0, 0, 0)).replica for _ in range(30))
    assert len(picks) == 3 and max(picks.values()) <= 20


def test_session_affinity_bounds_every_replica_load() -> None:
    # placing sessions one by one (each adds one request): no replica ever exceeds its bounded share
    sa = SessionAffinity(epsilon=0.25)
    loads = [0, 0, 0, 0, 0]
    for i in range(500):
        r = sa.choose(req(session=f"user-{i % 37}"), pool(*loads)).replica
        loads[int(r[1:])] += 1
        total = sum(loads)
        assert max(loads) <= -(-(1.25 * total) // 5) + 1, loads


def test_rendezvous_picks_the_lowest_h64_of_key_and_id_first_of_equals():
    rng = random.Random(0)
    for i in range(300):
        reps = [ReplicaState(f"r{rng.randrange(40)}-é") for _ in range(rng.randint(1, 10))]
        key = rng.choice([rng.getrandbits(64), f"s{i}", None])
        assert _rendezvous(key, reps) is min(reps, key=lambda r: _h64(key, r.id))
