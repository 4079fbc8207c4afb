"""The fair scheduler as a pure function of its snapshots: weighted shares between tenants, priority
bands before fairness, aging so a low class is not starved, bounded work with a tiny quantum."""

from __future__ import annotations

from collections import Counter

from tokenops.ops.fair_queue import FairPolicy, FairScheduler, FairSnapshot, Waiter


def drain(
    sched: FairScheduler, waiters: list[Waiter], now: float = 0.0, n: int | None = None
) -> list[Waiter]:
    """Serve `n` waiters (all by default) one by one, as slots free, at a fixed time."""
    left = {w.id: w for w in waiters}
    out: list[Waiter] = []
    while left and (n is None or len(out) < n):
        choice = sched.choose(FairSnapshot(tuple(left.values()), now))
        assert choice is not None
        out.append(left.pop(choice.waiter.id))
    return out


def flood(tenant: str, count: int, start_id: int = 0, priority: int = 1, t0: float = 0.0) -> list[Waiter]:
    return [Waiter(start_id + i, tenant, priority, t0 + i * 1e-3) for i in range(count)]


def test_nobody_waiting_chooses_nobody() -> None:
    assert FairScheduler().choose(FairSnapshot((), 0.0)) is None


def test_a_flooding_tenant_gets_its_share_not_the_line() -> None:
    # 100 waiting from the flood arrived first, 5 from the quiet tenant after them
    waiters = flood("noisy", 100) + flood("quiet", 5, start_id=1000, t0=1.0)
    served = drain(FairScheduler(FairPolicy(aging_s=None)), waiters, n=10)
    # round robin: the quiet tenant's five go in the first ten, not after the flood's hundred
    assert Counter(w.tenant for w in served) == {"noisy": 5, "quiet": 5}
    assert [w.id for w in served if w.tenant == "quiet"] == [1000, 1001, 1002, 1003, 1004]  # FIFO in a flow


def test_weights_set_the_shares() -> None:
    waiters = flood("a", 60) + flood("b", 60, start_id=100)
    served = drain(FairScheduler(FairPolicy(weights={"a": 3.0}, aging_s=None)), waiters, n=40)
    assert Counter(w.tenant for w in served) == {"a": 30, "b": 10}


def test_costs_in_tokens_share_tokens_not_requests() -> None:
    big = [Waiter(i, "big", 1, i * 1e-3, cost=400.0) for i in range(20)]
    small = [Waiter(100 + i, "small", 1, i * 1e-3, cost=100.0) for i in range(80)]
    served = drain(FairScheduler(FairPolicy(quantum=100.0, aging_s=None)), big + small, n=25)
    tokens = Counter()
    for w in served:
        tokens[w.tenant] += w.cost
    assert Counter(w.tenant for w in served) == {"small": 20, "big": 5}
    assert tokens["big"] == tokens["small"] == 2000


def test_a_tiny_quantum_is_skipped_in_whole_rounds() -> None:
    # a cost a million times the quantum: still one choice per call, and the same order as quantum 1
    waiters = [Waiter(i, t, 1, i * 1e-3, cost=1e6) for i, t in enumerate(["a", "b", "a", "b", "c"])]
    tiny = drain(FairScheduler(FairPolicy(quantum=1.0, aging_s=None)), waiters)
    assert [w.tenant for w in tiny] == ["a", "b", "c", "a", "b"]


def test_higher_priority_goes_first() -> None:
    low = flood("a", 5, priority=2)
    high = flood("b", 5, start_id=100, priority=0, t0=1.0)  # arrived later
    served = drain(FairScheduler(FairPolicy(aging_s=None)), low + high)
    assert [w.priority for w in served] == [0] * 5 + [2] * 5


def test_aging_lifts_a_low_class_that_waited_long_enough() -> None:
    sched = FairScheduler(FairPolicy(aging_s=10.0))
    old_low = Waiter(1, "batch", 2, enqueued_at=0.0)
    # at t=15 the class-2 request has aged one band (to 1): class 0 traffic still goes first
    fresh_high = [Waiter(10 + i, "chat", 0, enqueued_at=15.0) for i in range(3)]
    snap = FairSnapshot((old_low, *fresh_high), 15.0)
    assert sched.choose(snap).waiter.priority == 0
    # at t=20 it has aged two bands: it competes in band 0 and, a new flow there, takes its turn
    picks = [w.id for w in drain(sched, [old_low, *fresh_high], now=20.0)]
    assert 1 in picks[:2]
    choice = FairScheduler(FairPolicy(aging_s=10.0)).choose(FairSnapshot((old_low,), 25.0))
    assert choice.band == 0 and "aged 2" in choice.reason


def test_strict_priority_without_aging_starves_the_low_class() -> None:
    # the control for the aging test: with aging off, a steady class-0 stream keeps class 2 waiting
    sched = FairScheduler(FairPolicy(aging_s=None))
    low = Waiter(0, "batch", 2, 0.0)
    for i in range(50):
        high = Waiter(1 + i, "chat", 0, float(i))
        assert sched.choose(FairSnapshot((low, high), float(i) + 0.5)).waiter is high


def test_an_idle_tenant_banks_no_credit() -> None:
    sched = FairScheduler(FairPolicy(aging_s=None))
    # "a" is alone for a while: it must not bank turns to burst later against "b"
    drain(sched, flood("a", 20))
    served = drain(sched, flood("a", 10, start_id=100) + flood("b", 10, start_id=200))
    assert [w.tenant for w in served[:6]].count("a") == 3
