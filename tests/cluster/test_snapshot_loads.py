"""`PoolSnapshot.loads`, the one-pass form the policies read, agrees with `replica_load` and
`raw_load` replica by replica, saturation rules included."""

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
    # every saturation rule is exercised, and some replicas are not saturated
    assert any(load == math.inf for load, _ in got) and any(load < math.inf for load, _ in got)
