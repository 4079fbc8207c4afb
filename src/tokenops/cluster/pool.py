"""A replica pool: the replicas serving one model, their breakers, concurrency limits and live load,
and the balancing policy that places each request.

`ReplicaPool.acquire(request)` is the one entry point: it builds a snapshot of the replicas that may
take traffic (breaker not open, a concurrency slot free, not excluded by the caller), asks the policy
for a decision, claims the slot, and yields a `Lease`; when every available replica is at its limit
the caller waits here, in the gateway, until a slot frees or `queue_timeout` passes. Leaving the lease
records the outcome (breaker, concurrency limit, latency for outlier detection). This module does not speak
HTTP or retry: see `dispatch.py`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

import aiohttp
import httpx

from tokenops.cluster.concurrency import AIMDConfig, ConcurrencyLimiter, GradientConfig, make_limiter
from tokenops.cluster.health import (
    BreakerState,
    CircuitBreaker,
    Clock,
    LatencyTracker,
    OutlierConfig,
    ReplicaBreakerSettings,
    latency_outliers,
)
from tokenops.cluster.kv_event_stream import KVEventsEndpoint
from tokenops.cluster.policies import Decision, Policy
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, ReportedLoad, RequestInfo

ReplicaKind = Literal["tokenops", "vllm", "sglang", "openai"]


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A configured replica. `kind` says how to read its load (`tokenops`: `/v1/load` JSON;
    `vllm`/`sglang`: Prometheus `/metrics`; `openai`: not polled). `served_model` is the model name the
    replica expects in the body when it differs from the pool's name. `kv_events`: where a vLLM replica
    publishes its KV events (ZeroMQ), which make a prefix policy's index exact."""

    url: str
    id: str = ""
    weight: float = 1.0
    kind: ReplicaKind = "openai"
    served_model: str | None = None
    api_key: str | None = None
    kv_events: KVEventsEndpoint | None = None

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", self.url)
        if self.weight <= 0:
            raise ValueError(f"replica {self.id}: weight must be > 0")


class PoolUnavailable(Exception):
    """No replica of the pool can take traffic (all breakers open, or all excluded)."""


# a caller's own placement (the PD policy's), over every available replica whether or not it has a slot
# free; None: the replica it wants has no slot yet, wait for one
Chooser = Callable[[RequestInfo, PoolSnapshot], Decision | None]


class PoolOverloaded(Exception):
    """Every available replica stayed at its concurrency limit for the whole wait, or the waiting
    line of the request's priority class was full; the message says which."""


class Replica:
    """Live state of one replica: its spec, breaker, limiter, latency and the gateway's in-flight counts."""

    def __init__(
        self, spec: ReplicaSpec, breaker: CircuitBreaker, limiter: ConcurrencyLimiter, latency: LatencyTracker
    ) -> None:
        self.spec = spec
        self.breaker = breaker
        self.limiter = limiter
        self.latency = latency
        self.in_flight_prompt_tokens = 0
        self.in_flight_output_tokens = 0
        self.reported: ReportedLoad | None = None
        self.polled = False  # set by the load poller: from then on no report means "blind"

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def in_flight(self) -> int:
        return self.limiter.in_flight

    def effective_limit(self) -> int:
        # slow start shrinks the concurrency limit too, so the ramp holds whatever policy is in use
        return max(1, math.floor(self.limiter.limit * self.breaker.weight_factor()))

    def has_slot(self) -> bool:
        return self.in_flight < self.effective_limit()

    def state(self) -> ReplicaState:
        return ReplicaState(
            id=self.id,
            url=self.url,
            weight=self.spec.weight * self.breaker.weight_factor(),
            in_flight=self.in_flight,
            in_flight_prompt_tokens=self.in_flight_prompt_tokens,
            in_flight_output_tokens=self.in_flight_output_tokens,
            concurrency_limit=self.effective_limit(),
            reported=self.reported,
            polled=self.polled,
        )


@dataclass
class Lease:
    """One request's hold on one replica. Call `first_byte()` when the response starts (records time to
    first byte), and `fail(why)` if the replica answered badly without raising."""

    replica: Replica
    decision: Decision
    started: float
    clock: Clock
    ttfb: float | None = None
    failed: str | None = None

    def first_byte(self) -> None:
        if self.ttfb is None:
            self.ttfb = self.clock() - self.started

    def fail(self, why: str) -> None:
        self.failed = why


def reason_label(reason: str) -> str:
    """A decision's reason without its numbers ("prefix-hit 12/14" -> "prefix-hit"): a metric label
    with a bounded set of values."""
    return " ".join(w for w in reason.split() if not any(c.isdigit() for c in w))


# exceptions that mean the replica (or the path to it) failed, not the caller
REPLICA_FAULTS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    httpx.TransportError,  # the load poller's and health checker's client
    OSError,
    TimeoutError,
)


class ReplicaPool:
    def __init__(
        self,
        model: str,
        replicas: Iterable[ReplicaSpec],
        policy: Policy,
        *,
        breaker: ReplicaBreakerSettings | None = None,
        concurrency: AIMDConfig | GradientConfig | None = None,
        outlier: OutlierConfig | None = None,
        stale_after: float = 5.0,
        queue_timeout: float = 30.0,
        clock: Clock = time.monotonic,
        prompt_tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        # the model's tokenizer, for hashing prompts in the engine's token blocks (None: hash text)
        self.prompt_tokenizer = prompt_tokenizer
        self.outlier = outlier or OutlierConfig()
        self.stale_after = stale_after
        self.queue_timeout = queue_timeout
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        for spec in replicas:
            if spec.id in self.replicas:
                raise ValueError(f"pool {model}: duplicate replica id {spec.id!r}")
            self.replicas[spec.id] = Replica(
                spec,
                CircuitBreaker(breaker, clock),
                make_limiter(concurrency),
                LatencyTracker(self.outlier.alpha),
            )
        if not self.replicas:
            raise ValueError(f"pool {model}: needs at least one replica")
        # placements by (replica, reason label), for the gateway's /metrics
        self.picks: collections.Counter[tuple[str, str]] = collections.Counter()
        self._changed = asyncio.Event()  # set (and replaced) when a slot frees or the queue changes
        self._waiters: list[tuple[int, int]] = []  # heap of (priority class, arrival number)
        self._seq = itertools.count()

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self, exclude: Iterable[str] = (), *, need_slot: bool = True) -> PoolSnapshot:
        """Replicas a policy may choose from now: breaker admits traffic, not excluded, and (unless
        `need_slot=False`) a concurrency slot is free."""
        skip = set(exclude)
        states = tuple(
            r.state()
            for r in self.replicas.values()
            if r.id not in skip and r.breaker.available() and (r.has_slot() or not need_slot)
        )
        return PoolSnapshot(states, now=self.clock(), stale_after=self.stale_after)

    def available(self, exclude: Iterable[str] = ()) -> bool:
        skip = set(exclude)
        return any(r.breaker.available() for r in self.replicas.values() if r.id not in skip)

    def capacity(self) -> int:
        """Requests the pool takes at once now: its available replicas' concurrency limits summed
        (at least 1, so a request still goes and learns that no replica is up)."""
        return max(1, sum(r.effective_limit() for r in self.replicas.values() if r.breaker.available()))

    def utilisation(self) -> float:
        return self.snapshot(need_slot=False).utilisation()

    # -- placing a request -------------------------------------------------------------------

    @asynccontextmanager
    async def acquire(
        self,
        request: RequestInfo,
        exclude: Iterable[str] = (),
        *,
        max_wait: float | None = None,
        max_queued: int | None = None,
        choose: Chooser | None = None,
    ) -> AsyncIterator[Lease]:
        """Choose a replica for `request` and hold a slot on it for the `async with` block.

        Waits (up to `max_wait`, default `queue_timeout`) while every available replica is at its
        concurrency limit; waiters are served by priority class (0 first), first come first served
        within a class. Raises `PoolUnavailable` when no replica may take traffic at all, and
        `PoolOverloaded` when the wait runs out or `max_queued` requests of the same class already wait.
        `choose` replaces the pool's policy (the PD dispatch places the request itself) and sees
        replicas at their limit too, so a session bound to a busy replica waits for it.
        """
        skip = set(exclude)
        wait = self.queue_timeout if max_wait is None else max_wait
        deadline = self.clock() + wait
        ticket: tuple[int, int] | None = None
        try:
            while True:
                if not self.available(skip):
                    raise PoolUnavailable(f"no replica of {self.model} is available")
                if ticket is None:
                    my_turn = not any(w[0] <= request.priority for w in self._waiters)
                else:
                    my_turn = self._waiters[0] == ticket
                if my_turn:
                    decision = self._choose(request, skip, choose)
                    if decision is not None:
                        replica = self.replicas[decision.replica]
                        if replica.breaker.allow():
                            break
                        if choose is None:
                            continue  # lost the last probe slot to another request: choose again
                if ticket is None:
                    line = sum(1 for w in self._waiters if w[0] == request.priority)
                    if max_queued is not None and line >= max_queued:
                        raise PoolOverloaded(f"its waiting line is full ({max_queued} requests)")
                    ticket = (request.priority, next(self._seq))
                    heapq.heappush(self._waiters, ticket)
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise PoolOverloaded(f"no slot freed within {wait:g} s")
                # wake on a freed slot or a change of queue head, or periodically: breakers move to
                # half-open by the clock alone
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), timeout=min(remaining, 0.25))
                except TimeoutError:
                    pass
        finally:
            if ticket is not None:
                self._waiters.remove(ticket)
                heapq.heapify(self._waiters)
                self._notify()

        self.picks[(replica.id, reason_label(decision.reason))] += 1
        replica.limiter.start()
        replica.in_flight_prompt_tokens += request.prompt_tokens
        replica.in_flight_output_tokens += request.max_tokens
        lease = Lease(replica, decision, self.clock(), self.clock)
        verdict: bool | None = True  # True ok, False replica fault, None neither (caller gave up)
        try:
            yield lease
        except REPLICA_FAULTS as exc:
            lease.fail(f"{type(exc).__name__}: {exc}")
            raise
        except BaseException:
            verdict = None  # cancelled, or the caller's own error: not the replica's fault
            raise
        finally:
            if lease.failed is not None:
                verdict = False
            replica.in_flight_prompt_tokens -= request.prompt_tokens
            replica.in_flight_output_tokens -= request.max_tokens
            self._record(replica, lease, verdict)
            self._notify()

    def _choose(self, request: RequestInfo, skip: set[str], choose: Chooser | None) -> Decision | None:
        if choose is None:
            snap = self.snapshot(skip)
            return self.policy.choose(request, snap) if snap.replicas else None
        decision = choose(request, self.snapshot(skip, need_slot=False))
        if decision is None or not self.replicas[decision.replica].has_slot():
            return None
        return decision

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _record(self, replica: Replica, lease: Lease, verdict: bool | None) -> None:
        if verdict is None:
            replica.limiter.in_flight = max(0, replica.limiter.in_flight - 1)
            replica.breaker.release_probe()
            return
        replica.limiter.finish(ok=verdict, latency=lease.ttfb)
        was_open = replica.breaker.state is BreakerState.OPEN
        if verdict:
            replica.breaker.success()
            if lease.ttfb is not None:
                replica.latency.observe(lease.ttfb)
                trackers = {r.id: r.latency for r in self.replicas.values()}
                for rid in latency_outliers(trackers, self.outlier):
                    self.replicas[rid].breaker.trip("latency outlier")
                    self._on_open(rid)
        else:
            replica.breaker.failure(lease.failed or "failure")
            if not was_open and replica.breaker.state is BreakerState.OPEN:
                self._on_open(replica.id)

    def _on_open(self, replica_id: str) -> None:
        # an opened replica has usually crashed or will be restarted: its KV cache is not to be trusted
        self.forget_cache(replica_id)
        self.replicas[replica_id].latency = LatencyTracker(self.outlier.alpha)

    def forget_cache(self, replica_id: str) -> None:
        """Drop what the policy's prefix index believes this replica caches."""
        index = getattr(self.policy, "index", None)
        if index is not None:
            index.remove_replica(replica_id)

    @property
    def waiting(self) -> int:
        return len(self._waiters)
