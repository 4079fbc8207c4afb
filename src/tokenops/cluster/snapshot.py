"""Typed, immutable snapshots that balancing policies read: one replica's state, the request being
placed, and the pool as a whole at one instant.

This module owns the *shape* of what a policy may look at and the one shared notion of load
(`replica_load`, `is_saturated`). It does not collect the numbers (the pool and the load poller do)
and it does not decide anything (the policies do). Because a snapshot is plain frozen data, the fleet
simulator hands a policy the same kind of input the live gateway does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """What a replica said about itself (our engine's `/v1/load`, or vLLM/SGLang `/metrics`)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    read_at: float = 0.0  # monotonic time the report was read
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # our engine's /v1/load only: what a PD placement weighs, and where its KV transfer server listens
    context_tokens: int = 0  # the running sequences' contexts summed
    kv_free_tokens: int = 0
    kv_total_tokens: int = 0
    kv_transfer: tuple[str, str, int] | None = None  # (engine id, host, port)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the gateway sees it at snapshot time.

    `in_flight_*` are the gateway's own counts (always fresh). `reported` is the replica's last load
    report, or None when nobody polls it (a provider endpoint); `polled` says a poller is configured,
    so a missing or old report means we are blind to it and must treat it as saturated.
    """

    id: str
    url: str = ""
    weight: float = 1.0  # effective weight: configured weight times the slow-start factor
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    in_flight_output_tokens: int = 0  # max_tokens still outstanding for in-flight requests
    concurrency_limit: int | None = None  # the adaptive limiter's current limit; None = unlimited
    reported: ReportedLoad | None = None
    polled: bool = False
    # the load terms that do not depend on the clock, worked out once here rather than in every
    # decision that reads this state: (outstanding requests per weight, saturated whatever the time,
    # when the report a staleness check reads was taken: +inf when none is checked)
    _load: tuple[float, bool, float] = field(default=(0.0, False, math.inf), init=False, repr=False,
                                             compare=False)  # fmt: skip

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"replica {self.id}: weight must be > 0, got {self.weight}")
        rep, n, limit = self.reported, self.in_flight, self.concurrency_limit
        full = limit is not None and n >= limit
        if rep is None:
            read_at = math.inf
            full = full or self.polled
        else:
            m = rep.running + rep.waiting
            if m > n:
                n = m
            if rep.kv_usage >= 0.99 and rep.waiting > 0:
                full = True
            read_at = rep.read_at if self.polled else math.inf
        object.__setattr__(self, "_load", (n / self.weight, full, read_at))


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request being placed.

    `block_hashes` is the chained hash of the prompt's blocks (token blocks when the gateway has token
    ids, text blocks otherwise; see `prefix_index.block_hashes_*`). `block_tokens` is how many prompt
    tokens one block stands for, so a match length converts to cached tokens.
    """

    model: str
    session_id: str | None = None
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 16
    prompt_tokens: int = 0
    max_tokens: int = 0
    priority: int = 0  # priority class, 0 = most important (the gateway's convention); not used by balancing


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The pool at one instant: the replicas a policy may choose from (the pool has already removed
    open breakers and excluded replicas) plus the clock and staleness bound."""

    replicas: tuple[ReplicaState, ...]
    now: float = 0.0
    stale_after: float = 5.0  # seconds after which a report no longer counts
    _by_id: dict[str, ReplicaState] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def by_id(self) -> dict[str, ReplicaState]:
        """The replicas by id, built on first use (most policies never look one up)."""
        if self._by_id is None:
            object.__setattr__(self, "_by_id", {r.id: r for r in self.replicas})
        return self._by_id  # type: ignore[return-value]

    def is_saturated(self, r: ReplicaState) -> bool:
        """Stale or missing reports from a polled replica, a full KV cache, or a full concurrency
        limit all mean: do not send more here while anything else is available."""
        _, full, read_at = r._load
        return full or self.now - read_at > self.stale_after

    def replica_load(self, r: ReplicaState) -> float:
        """Outstanding requests per unit weight; infinite when saturated.

        The gateway's own in-flight count is fresh but misses other gateways' traffic; the report
        sees everything but lags. The larger of the two is the safer estimate.
        """
        return math.inf if self.is_saturated(r) else r._load[0]

    def raw_load(self, r: ReplicaState) -> float:
        """`replica_load` without the saturation rule: the tie-breaker when every replica is saturated."""
        return r._load[0]

    def loads(self, replicas: Sequence[ReplicaState]) -> list[tuple[float, float]]:
        """(`replica_load`, `raw_load`) of each replica in one pass: what a policy ranking by load
        reads."""
        now, stale, inf = self.now, self.stale_after, math.inf
        out = []
        for r in replicas:
            raw, full, read_at = r._load
            out.append((inf if full or now - read_at > stale else raw, raw))
        return out

    def utilisation(self) -> float:
        """Pool pressure in 0..1 (inf when nothing is available): mean of each replica's in-flight
        over its concurrency limit or its KV usage, whichever is higher."""
        if not self.replicas:
            return math.inf
        total = 0.0
        for r in self.replicas:
            if self.is_saturated(r):
                total += 1.0
                continue
            u = r.reported.kv_usage if r.reported is not None else 0.0
            if r.concurrency_limit:
                u = max(u, r.in_flight / r.concurrency_limit)
            total += min(u, 1.0)
        return total / len(self.replicas)
