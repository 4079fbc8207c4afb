"""`PoolSnapshot.loads`, the one-pass form the policies read, agrees with `replica_load` and
`raw_load` replica by replica, and all three with the saturation rules written out here."""

import itertools
import math

from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, ReportedLoad


def test_loads_in_one_pass_equal_the_per_replica_rules():
    reports = [
        None,
        ReportedLoad(running=3, waiting=0, kv_usage=0.5, read_at=9.0),  # fresh, more than in flight
        ReportedLoad(running=0, waiting=2, kv_usage=0.995, read_at=9.0),  # full KV with a queue
        ReportedLoad(running=1, waiting=0, kv_usage=0.2, read_at=1.0),  # stale
    ]
    replicas = [
        ReplicaState(f"r{i}", weight=w, in_flight=n, concurrency_limit=limit, reported=rep, polled=polled)
        for i, (w, n, limit, rep, polled) in enumerate(
            itertools.product((1.0, 0.5), (0, 2), (None, 2), reports, (False, True))
        )
    ]
    pool = PoolSnapshot(tuple(replicas), now=10.0, stale_after=5.0)
    got = pool.loads(pool.replicas)
    assert got == [(pool.replica_load(r), pool.raw_load(r)) for r in replicas]
    assert got == [_expected(r, now=10.0, stale_after=5.0) for r in replicas]
    # every saturation rule is exercised, and some replicas are not saturated
    assert any(load == math.inf for load, _ in got) and any(load < math.inf for load, _ in got)


def _expected(r: ReplicaState, now: float, stale_after: float) -> tuple[float, float]:
    """The rules as the snapshot's docstrings state them, one replica at a time."""
    rep = r.reported
    outstanding = max(r.in_flight, rep.running + rep.waiting) if rep is not None else r.in_flight
    raw = outstanding / r.weight
    blind = r.polled and (rep is None or now - rep.read_at > stale_after)
    kv_full = rep is not None and rep.kv_usage >= 0.99 and rep.waiting > 0
    at_limit = r.concurrency_limit is not None and r.in_flight >= r.concurrency_limit
    return (math.inf if blind or kv_full or at_limit else raw, raw)


def test_a_state_rebuilt_with_new_counts_has_new_loads():
    # what a decision reads is worked out when the state is built: a replaced state must not keep
    # the old one's terms
    import dataclasses

    r = ReplicaState("a", in_flight=1, concurrency_limit=2, polled=True,
                     reported=ReportedLoad(running=1, read_at=9.0))  # fmt: skip
    pool = PoolSnapshot((r,), now=10.0)
    assert pool.loads((r,)) == [(1.0, 1.0)]
    full = dataclasses.replace(r, in_flight=2)
    assert pool.loads((full,)) == [(math.inf, 2.0)]
    assert PoolSnapshot((r,), now=20.0).loads((r,)) == [(math.inf, 1.0)]  # the report went stale
