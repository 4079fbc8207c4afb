"""Weighted fair admission across tenants and priority classes: which waiting request goes next.

A request that finds its line saturated waits in its flow, a (tenant, priority class) pair. When a
slot frees, `FairScheduler.choose` looks at a snapshot of every waiter and picks one: the lowest
(most urgent) priority band first, deficit round robin over the tenants inside that band, first
come first served inside a tenant. Strict priority alone starves the low classes under a steady high
class load, so a waiter is promoted one band per `aging_s` it has waited. Each tenant earns
`quantum * weight` credit per round and spends the request's cost (1 per request, or its tokens),
so a tenant flooding the line gets its share and no more. Pure: no clock, no I/O, no asyncio; the
gateway's admission gate and the simulator call the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request waiting for a slot."""

    id: int
    tenant: str
    priority: int  # 0 is the most urgent class
    enqueued_at: float  # seconds, on the caller's clock
    cost: float = 1.0  # credit it spends when served: 1 per request, or its tokens


@dataclass(frozen=True, slots=True)
class FairSnapshot:
    waiters: tuple[Waiter, ...]
    now: float


@dataclass(frozen=True, slots=True)
class FairChoice:
    waiter: Waiter
    band: int  # the band it was served in (its class, less the bands aging promoted it)
    reason: str


@dataclass(frozen=True, slots=True)
class FairPolicy:
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> weight; others default_weight
    default_weight: float = 1.0
    quantum: float = 1.0  # credit per round at weight 1, in cost units
    aging_s: float | None = 10.0  # a waiter moves up one band per this many seconds (None: never)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def band(self, w: Waiter, now: float) -> int:
        if not self.aging_s:
            return w.priority
        return max(0, w.priority - int(max(0.0, now - w.enqueued_at) // self.aging_s))


@dataclass
class _Band:
    ring: list[str] = field(default_factory=list)  # active tenants in the order they became active
    pointer: int = 0
    credited: bool = False  # the tenant at the pointer has had this visit's quantum
    deficit: dict[str, float] = field(default_factory=dict)


class FairScheduler:
    """Deficit round robin per priority band over a snapshot of the waiters. The state it keeps
    between calls is the round: whose turn it is and each tenant's unspent credit."""

    def __init__(self, policy: FairPolicy | None = None) -> None:
        self.policy = policy or FairPolicy()
        self._bands: dict[int, _Band] = {}

    def choose(self, snap: FairSnapshot) -> FairChoice | None:
        if not snap.waiters:
            return None
        p = self.policy
        bands = {w.id: p.band(w, snap.now) for w in snap.waiters}
        top = min(bands.values())
        heads: dict[str, Waiter] = {}  # each tenant's oldest waiter in the top band
        for w in sorted(snap.waiters, key=lambda w: (w.enqueued_at, w.id)):
            if bands[w.id] == top:
                heads.setdefault(w.tenant, w)
        state = self._bands.setdefault(top, _Band())
        self._sync(state, heads)
        tenant = self._next(state, heads)
        w = heads[tenant]
        state.deficit[tenant] -= w.cost
        promoted = w.priority - top
        reason = f"band {top}" + (f" (class {w.priority}, aged {promoted})" if promoted else "")
        return FairChoice(w, top, f"{reason}, tenant {tenant} credit {state.deficit[tenant]:.2f}")

    def _sync(self, state: _Band, heads: dict[str, Waiter]) -> None:
        """Drop tenants with nobody waiting (their credit goes: DRR gives no credit for idle time),
        append the newly active ones at the end of the round."""
        ring, at = state.ring, state.pointer
        current = ring[at] if ring else None
        # who is next in the old round after the current tenant, should it leave
        after = [t for t in ring[at + 1 :] + ring[:at] if t in heads]
        kept = [t for t in ring if t in heads]
        for t in set(state.ring) - set(kept):
            state.deficit.pop(t, None)
        kept += [t for t in heads if t not in state.deficit]
        for t in kept:
            state.deficit.setdefault(t, 0.0)
        if current in kept:
            state.pointer = kept.index(current)
        else:
            # the tenant whose turn it was left: the turn passes to the next one, fresh
            state.pointer = kept.index(after[0]) if after else 0
            state.credited = False
        state.ring = kept

    def _next(self, state: _Band, heads: dict[str, Waiter]) -> str:
        """Visit tenants in round order, crediting each its quantum once per visit, until one can
        pay for its head request; whole rounds nobody could pay for are skipped in one step, so the
        work is bounded by the number of tenants, not by how small the quantum is."""
        p = self.policy
        n = len(state.ring)
        for _ in range(2):
            for _ in range(n):
                t = state.ring[state.pointer]
                if not state.credited:
                    state.deficit[t] += p.quantum * p.weight(t)
                    state.credited = True
                if state.deficit[t] >= heads[t].cost:
                    return t  # stays its turn: DRR serves a tenant while its credit lasts
                state.pointer = (state.pointer + 1) % n
                state.credited = False
            # a whole round and nobody could pay: add the rounds the readiest tenant still lacks
            rounds = min(
                math.ceil((heads[t].cost - state.deficit[t]) / (p.quantum * p.weight(t))) for t in state.ring
            )
            for t in state.ring:
                state.deficit[t] += max(0, rounds - 1) * p.quantum * p.weight(t)
        raise AssertionError("a tenant can always pay after the skipped rounds")


__all__ = ["Waiter", "FairSnapshot", "FairChoice", "FairPolicy", "FairScheduler"]
