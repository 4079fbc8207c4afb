"""Prefill/decode placement: where a request's (incremental) prefill runs and which decode worker holds
the sequence, decided by plain policy objects over a `PDSnapshot`.

A PD deployment has a prefill pool and a decode pool; a colocated one has only workers that do both.
Each policy has one method, `place(job, snapshot) -> PDDecision`, does no I/O and keeps only small
state of its own (a session's binding to a decode worker), so the live gateway and the fleet simulator
run the very same objects. Costs are estimated with the one `PerfModel`. This module does not move KV
(the engines do, see `tokenops.engine`) and does not send requests (the cluster's PD dispatch does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tokenops.cluster.perf_model import PerfModel


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One prefill, decode or colocated worker at snapshot time."""

    id: str
    role: str = "both"  # "prefill" | "decode" | "both"
    queued_requests: int = 0  # prefills waiting on this worker
    queued_prefill_tokens: int = 0  # their uncached prompt tokens
    running: int = 0  # sequences in its decode batch
    context_tokens: int = 0  # sum of the running sequences' contexts
    kv_free_tokens: int = 0
    kv_total_tokens: int = 0
    ttft_recent_s: float | None = None  # windowed TTFT observed for prefills here (None: no data)
    itl_recent_s: float | None = None  # windowed inter-token latency of its decode batch
    healthy: bool = True

    @property
    def kv_headroom(self) -> float:
        return self.kv_free_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """A request about to be prefilled: a session's first round or an incremental prefill."""

    request_id: str
    prompt_tokens: int
    session_id: str | None = None
    round: int = 0  # 0 for a session's first request
    cached_tokens: Mapping[str, int] = field(default_factory=dict)  # worker id -> prompt tokens it holds
    max_tokens: int = 0
    arrived_at: float = 0.0

    def cached_on(self, worker: str) -> int:
        return min(self.cached_tokens.get(worker, 0), self.prompt_tokens)


@dataclass(frozen=True, slots=True)
class PDSnapshot:
    prefill: tuple[WorkerLoad, ...]  # empty in a colocated deployment
    decode: tuple[WorkerLoad, ...]  # decode-only or colocated workers
    now: float = 0.0
    ttft_slo_s: float = float("inf")
    itl_slo_s: float = float("inf")

    def healthy_prefill(self) -> tuple[WorkerLoad, ...]:
        return tuple(w for w in self.prefill if w.healthy)

    def healthy_decode(self) -> tuple[WorkerLoad, ...]:
        return tuple(w for w in self.decode if w.healthy)


@dataclass(frozen=True, slots=True)
class PDDecision:
    decode: str  # the worker that holds the sequence and streams its tokens
    prefill: str | None  # the prefill worker, or None: prefill on the decode worker itself
    reason: str
    transfer_tokens: int = 0  # prompt KV tokens shipped from the prefill worker to the decode worker

    @property
    def remote(self) -> bool:
        return self.prefill is not None


class PDPolicy(Protocol):
    name: str

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision: ...

    def forget_worker(self, worker: str) -> None:
        """A worker died or left: drop whatever binds to it."""
        ...


def least_busy_decode(job: PrefillJob, snapshot: PDSnapshot) -> WorkerLoad:
    """The decode worker with the most KV headroom, then the fewest running sequences; one holding
    more of the prompt wins ties."""
    workers = snapshot.healthy_decode() or snapshot.decode
    if not workers:
        raise ValueError("no decode worker")
    return max(workers, key=lambda w: (w.kv_headroom, -w.running, job.cached_on(w.id), w.id))


def least_queued_prefill(job: PrefillJob, snapshot: PDSnapshot) -> WorkerLoad | None:
    """The prefill worker with the least queued uncached work for this job (its own cache counted)."""
    workers = snapshot.healthy_prefill()
    if not workers:
        return None
    return min(
        workers,
        key=lambda w: (w.queued_prefill_tokens + job.prompt_tokens - job.cached_on(w.id), w.id),
    )


class SessionBindings:
    """Session id -> decode worker, bounded (oldest dropped first) so a long-lived gateway's memory
    does not grow with every session it has ever seen."""

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._bound: dict[str, str] = {}

    def get(self, session: str | None) -> str | None:
        return self._bound.get(session) if session is not None else None

    def bind(self, session: str | None, worker: str) -> None:
        if session is None:
            return
        self._bound.pop(session, None)
        self._bound[session] = worker
        if len(self._bound) > self._limit:
            self._bound.pop(next(iter(self._bound)))

    def forget_worker(self, worker: str) -> None:
        for s in [s for s, w in self._bound.items() if w == worker]:
            del self._bound[s]


class Colocated:
    """No disaggregation: every worker prefills and decodes its own requests; a session stays on the
    worker that holds its history while that worker is healthy."""

    name = "colocated"

    def __init__(self) -> None:
        self.bindings = SessionBindings()

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        bound = self.bindings.get(job.session_id)
        healthy = {w.id for w in snapshot.healthy_decode()}
        if bound in healthy:
            return PDDecision(bound, None, "session-bound")
        worker = least_busy_decode(job, snapshot)
        self.bindings.bind(job.session_id, worker.id)
        return PDDecision(worker.id, None, "kv-headroom")

    def forget_worker(self, worker: str) -> None:
        self.bindings.forget_worker(worker)


class StaticPD:
    """Every prefill on a prefill worker, as vLLM's and production-stack's disaggregated paths do; the
    decode side ships its session history back each round (what AMPD avoids)."""

    name = "static_pd"

    def __init__(self, perf: PerfModel | None = None) -> None:
        self.perf = perf
        self.bindings = SessionBindings()

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        bound = self.bindings.get(job.session_id)
        healthy = {w.id for w in snapshot.healthy_decode()}
        decode = bound if bound in healthy else least_busy_decode(job, snapshot).id
        self.bindings.bind(job.session_id, decode)
        prefill = least_queued_prefill(job, snapshot)
        if prefill is None:
            return PDDecision(decode, None, "no-prefill-worker")
        return PDDecision(decode, prefill.id, "static-remote", transfer_tokens=job.prompt_tokens)

    def forget_worker(self, worker: str) -> None:
        self.bindings.forget_worker(worker)
