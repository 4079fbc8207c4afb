"""Prefill/decode placement: where a request's (incremental) prefill runs and which decode worker holds
the sequence, decided by plain policy objects over a `PDSnapshot`.

A PD deployment has a prefill pool and a decode pool; a colocated one has only workers that do both.
Each policy has one method, `place(job, snapshot) -> PDDecision`, does no I/O and keeps only small
state of its own (a session's binding to a decode worker), so the live gateway and the fleet simulator
run the very same objects. Costs are estimated with the one `PerfModel`. This module does not move KV
(the engines do, see `tokenops.engine`) and does not send requests (the cluster's PD dispatch does).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from tokenops.cluster.perf_model import PerfModel, StepShape


@dataclass(frozen=True, slots=True)
class StreamProgress:
    """One answer a decode worker is streaming, as far as it has come: the gaps between its tokens so
    far, their sum, and the tokens still to come (at most: an answer can end sooner). The ITL SLO is
    on a stream's mean gap, so this is what a stretched step can still cost it."""

    gaps: int
    elapsed_s: float
    remaining: int

    def mean_gap_s(self, step_s: float, stretched: int = 0, stretched_s: float = 0.0) -> float:
        """Its mean gap at the end if its remaining gaps take `step_s` each, `stretched` of them
        (the first ones) `stretched_s` instead."""
        n = self.gaps + self.remaining
        if n <= 0:
            return 0.0
        k = min(stretched, self.remaining)
        return (self.elapsed_s + k * stretched_s + (self.remaining - k) * step_s) / n


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One prefill, decode or colocated worker at snapshot time."""

    id: str
    role: str = "both"  # "prefill" | "decode" | "both"
    queued_requests: int = 0  # prefills waiting on this worker
    queued_prefill_tokens: int = 0  # uncached prompt tokens still to compute (queued, and in progress)
    running: int = 0  # sequences in its decode batch
    context_tokens: int = 0  # sum of the running sequences' contexts
    kv_free_tokens: int = 0
    kv_total_tokens: int = 0
    # its recent prefill legs' observed time over the time AMPD modelled for them (`LegPace`; None:
    # no data)
    leg_pace: float | None = None
    itl_recent_s: float | None = None  # windowed inter-token latency of its decode batch
    healthy: bool = True
    # prefill legs bound to this worker still waiting at the gateway for one of its slots (the
    # dispatch's prefill gate or the prefill pool's line): not on the engine yet, but ahead of a new leg
    waiting_legs: int = 0
    # their prompt tokens this worker's cache lacks, a prefix they share (or share with a leg under way
    # there) counted once: the first leg to go leaves it cached for the others (`prefill_backlog`)
    waiting_prefill_tokens: int = 0
    # the answers it is streaming (through this gateway, or in the simulator all of them): what their
    # mean gaps can still take; empty when unknown
    streams: tuple[StreamProgress, ...] = ()

    @property
    def kv_headroom(self) -> float:
        return self.kv_free_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0

    @property
    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens a new prefill leg here waits behind: on the engine, and waiting for its slots."""
        return self.queued_prefill_tokens + self.waiting_prefill_tokens

    @property
    def sequences(self) -> int:
        """Sequences it holds or is about to: running, and queued for their prefill."""
        return self.running + self.queued_requests


class WindowedRatio:
    """sum(numerators) / sum(denominators) of what was observed in the last `window_s` seconds; None
    when nothing is left in the window, so an idle worker reports nothing rather than a stale figure.
    The gateway keeps each decode worker's observed ITL in one (`ItlWindow`), and the gateway and the
    simulator each prefill worker's leg pace (`LegPace`)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: collections.deque[tuple[float, float, float]] = collections.deque()
        self._num = 0.0
        self._den = 0.0

    def observe(self, now: float, num: float, den: float = 1.0) -> None:
        self._seen.append((now, num, den))
        self._num += num
        self._den += den
        self._expire(now)

    def value(self, now: float) -> float | None:
        self._expire(now)
        return self._num / self._den if self._den > 0 else None

    def _expire(self, now: float) -> None:
        while self._seen and self._seen[0][0] < now - self.window_s:
            _, num, den = self._seen.popleft()
            self._num -= num
            self._den -= den
        if not self._seen:
            self._num, self._den = 0.0, 0.0  # no float drift left behind


# how far back a prefill worker's leg pace looks: several legs at the rates the gateway sees
LEG_PACE_WINDOW_S = 10.0


class LegPace(WindowedRatio):
    """A prefill worker's recent remote legs: their observed time (from the placing, when the leg asks
    for a slot, to its answer; in the simulator to its KV ready) over the time AMPD modelled for them,
    as one ratio of sums. AMPD scales a leg's modelled time by it (never down), so a worker slower than
    the model, or a backlog the model undercounts, shows in every leg's estimate in proportion to its
    size, where a floor at the observed leg time gave a short leg a long one's time and hid the queue
    growing behind it. Legs that fail are not observed, in either world."""

    def __init__(self, window_s: float = LEG_PACE_WINDOW_S) -> None:
        super().__init__(window_s)

    def observe(self, now: float, observed_s: float, modelled_s: float) -> None:
        if modelled_s > 0:  # a leg no policy modelled (a rule-based one's) says nothing about the model
            super().observe(now, observed_s, modelled_s)


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

    def uncached_on(self, worker: str, history_from: str | None = None) -> int:
        """Prompt tokens a prefill on `worker` computes: what its cache lacks, or, working on the
        session's history pulled from `history_from` first (our incremental transfer), what neither
        holds. The live dispatch, the simulator and AMPD's estimate all count a leg so."""
        held = self.cached_on(worker)
        if history_from is not None:
            held = max(held, self.cached_on(history_from))
        return self.prompt_tokens - held


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
    estimate: PrefillEstimate | None = None  # what AMPD weighed (None for the rule-based policies)
    # a remote prefill's worker pulls the session's history from the decode worker (our incremental
    # transfer); False: it recomputes what its own cache lacks, as vLLM's disaggregated path does
    pull_history: bool = True

    @property
    def remote(self) -> bool:
        return self.prefill is not None


class PDPolicy(Protocol):
    name: str
    bindings: SessionBindings  # session -> decode worker; the dispatch seeds it from shared bindings

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision: ...

    def forget_worker(self, worker: str) -> None:
        """A worker died or left: drop whatever binds to it."""
        ...


def least_busy_decode(job: PrefillJob, snapshot: PDSnapshot) -> WorkerLoad:
    """The decode worker with the most KV headroom, then the fewest sequences (running, or queued
    for their prefill: requests placed a moment ago are there); one holding more of the prompt wins
    ties."""
    workers = snapshot.healthy_decode() or snapshot.decode
    if not workers:
        raise ValueError("no decode worker")
    return max(workers, key=lambda w: (w.kv_headroom, -w.sequences, job.cached_on(w.id), w.id))


def least_queued_prefill(job: PrefillJob, snapshot: PDSnapshot) -> WorkerLoad | None:
    """The prefill worker with the least uncached work for this job: the prompt tokens ahead of it
    there (on the engine, and in legs waiting at the gateway for its slots) plus the job's own tokens
    its cache lacks, so a cache hit wins only when it saves more than the wait behind it costs."""
    workers = snapshot.healthy_prefill()
    if not workers:
        return None
    return min(
        workers,
        key=lambda w: (w.prefill_backlog_tokens + job.uncached_on(w.id), w.id),
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
    """Every prefill on a prefill worker, as vLLM's and production-stack's disaggregated paths do.

    As they ship it (`incremental=False`) the prefill worker recomputes whatever of a session's history
    its own cache lacks and the whole prompt's KV goes to the decode worker each round. With
    `incremental=True` it uses our incremental transfer as AMPD's remote rounds do: the prefill worker
    pulls the history from the decode worker and only the new blocks travel back (what the live
    dispatch does for every remote round), so only the placement differs from AMPD's."""

    def __init__(self, perf: PerfModel | None = None, *, incremental: bool = False) -> None:
        self.perf = perf
        self.incremental = incremental
        self.name = "static_pd_incremental" if incremental else "static_pd"
        self.bindings = SessionBindings()

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        bound = self.bindings.get(job.session_id)
        healthy = {w.id for w in snapshot.healthy_decode()}
        decode = bound if bound in healthy else least_busy_decode(job, snapshot).id
        self.bindings.bind(job.session_id, decode)
        prefill = least_queued_prefill(job, snapshot)
        if prefill is None:
            return PDDecision(decode, None, "no-prefill-worker")
        shipped = job.uncached_on(decode) if self.incremental else job.prompt_tokens
        return PDDecision(
            decode, prefill.id, "static-remote", transfer_tokens=shipped, pull_history=self.incremental
        )

    def forget_worker(self, worker: str) -> None:
        self.bindings.forget_worker(worker)


class ConditionalPD:
    """Remote prefill only when the part of the prompt the decode worker lacks is long enough, the rule
    Dynamo's and llm-d's disaggregated routers ship: Dynamo prefills remotely when the uncached length
    exceeds `max_local_prefill_length` (1000 tokens) and the prefill queue holds fewer than
    `max_prefill_queue_size` (2) requests; llm-d's prefix-based decider when the decode pod's non-cached
    suffix is at least `nonCachedTokens` (0 in llm-d's code, i.e. always; its guides set a few hundred,
    and 256 is the default here and in the gateway's `pd:` config).
    Dynamo's queue holds the prefill requests no prefill worker has taken yet, so a worker's count
    here is its engine's queue plus the legs waiting at the gateway for its slots; llm-d has no such
    check. The prefill worker is `least_queued_prefill`'s, for both."""

    def __init__(
        self,
        min_remote_tokens: int = 1000,
        *,
        inclusive: bool = False,
        max_prefill_queue: int | None = 2,
        name: str = "conditional",
    ) -> None:
        self.min_remote_tokens = min_remote_tokens
        self.inclusive = inclusive
        self.max_prefill_queue = max_prefill_queue
        self.name = name
        self.bindings = SessionBindings()

    @classmethod
    def dynamo(cls, max_local_prefill_length: int = 1000, max_prefill_queue_size: int = 2) -> ConditionalPD:
        return cls(
            max_local_prefill_length, max_prefill_queue=max_prefill_queue_size, name="conditional_dynamo"
        )

    @classmethod
    def llm_d(cls, non_cached_tokens: int = 256) -> ConditionalPD:
        return cls(non_cached_tokens, inclusive=True, max_prefill_queue=None, name="conditional_llm_d")

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        decode = _bound_decode(self.bindings, job, snapshot)
        uncached = job.uncached_on(decode)
        long_enough = (
            uncached >= self.min_remote_tokens if self.inclusive else uncached > self.min_remote_tokens
        )
        if not long_enough:
            return PDDecision(decode, None, "short-uncached")
        # Dynamo's queue size counts prefill requests no prefill worker has taken yet: here the legs
        # waiting at the gateway for the worker's slots, besides those queued on its engine
        workers = [
            w
            for w in snapshot.healthy_prefill()
            if self.max_prefill_queue is None or w.queued_requests + w.waiting_legs < self.max_prefill_queue
        ]
        if not workers:
            return PDDecision(
                decode, None, "prefill-queue-full" if snapshot.healthy_prefill() else "no-prefill-worker"
            )
        prefill = least_queued_prefill(job, PDSnapshot(tuple(workers), snapshot.decode))
        assert prefill is not None
        return PDDecision(decode, prefill.id, "long-uncached", transfer_tokens=uncached)

    def forget_worker(self, worker: str) -> None:
        self.bindings.forget_worker(worker)


def _bound_decode(bindings: SessionBindings, job: PrefillJob, snapshot: PDSnapshot) -> str:
    bound = bindings.get(job.session_id)
    if bound not in {w.id for w in snapshot.healthy_decode()}:
        bound = least_busy_decode(job, snapshot).id
        bindings.bind(job.session_id, bound)
    return bound


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """What AMPD weighs for one (incremental) prefill: modelled TTFT either way, and the decode
    batch's step time while a local prefill runs inside it."""

    local_ttft_s: float
    remote_ttft_s: float
    local_step_s: float  # the bound decode worker's step with the prefill in it (its ITL meanwhile)
    local_itl_s: float  # the running sequences' mean gap over the SLO's window with those steps in it
    remote_worker: str | None
    # running streams that meet the ITL SLO without the local prefill and would miss it with it
    local_itl_breaks: int = 0
    # the remote worker's leg as the model has it (placing to its answer), before its pace scales it:
    # what the leg's observed time is weighed against (`LegPace`)
    remote_leg_s: float = 0.0


# AMPD's tie-break: with both ways on time, a prefill goes remote while its modelled TTFT is within
# this share of the TTFT SLO; half leaves room for a remote estimate that runs short (the simulated
# split study and the live pair, docs/pd.md)
REMOTE_TTFT_SHARE = 0.5


class AMPD:
    """Adaptive PD for multi-round agent sessions (AMPD, arXiv 2602.14516).

    A session's first request binds it to the decode worker with the most KV headroom that can hold it;
    later rounds go there, so its history stays in one cache. Each (incremental) prefill then runs locally
    on that worker or remotely on a prefill worker, whichever the modelled costs and the live slack
    favour: remote TTFT = two requests' overhead + the prefill worker's queue (on its engine and in the
    legs waiting at the gateway for its slots) + its prefill of what it lacks + shipping the history it
    lacks there + shipping the new blocks back + the decode worker's first step (it recomputes the
    prompt's last block beside its batch), the least over the prefill workers; local TTFT = one request's
    overhead + the decode worker's queue + the prefill inside its batch (with the prefills already queued
    there), which stretches the running sequences' inter-token gaps to that step's time. The ITL SLO is on
    a stream's mean gap: local keeps it when every running stream that would meet it still does with
    the stretched steps in its remaining gaps (`WorkerLoad.streams`); where the streams are not known,
    when the batch's gap as observed (or modelled when there is none), with the stretched steps spread
    over `itl_window_tokens` tokens (1: every gap), stays within it. Each way is scored by the
    requests that would miss their SLO, the unit SLO attainment counts: local, the running streams its
    stretched steps take past the ITL SLO (counted one by one where the streams are known, else all
    or none) and this request if its TTFT is late; remote, this request if late. The fewer misses win,
    so a remote leg that is late anyway does not outweigh one stream a local prefill would break, and
    two streams outweigh it. On a tie with slack on both sides the prefill goes remote while its
    modelled TTFT is within `remote_ttft_share` of the TTFT SLO (the prefill pool's slack: a local
    prefill, though faster, spends decode-pool time that every running stream and later round pays
    for), else the faster way; on a tie with neither on time, or with no TTFT SLO, the faster way.
    The observed windowed ITL raises the modelled step (never lowers it), and a prefill worker's
    recent legs scale its modelled leg by their observed over modelled time (`LegPace`, never down),
    so a worker slower than the model says is treated as such."""

    name = "ampd"

    def __init__(
        self,
        perf: PerfModel,
        *,
        chunk_tokens: int | None = None,
        itl_window_tokens: int = 1,
        block_tokens: int = 16,
        remote_ttft_share: float = REMOTE_TTFT_SHARE,
    ) -> None:
        if itl_window_tokens < 1:
            raise ValueError("itl_window_tokens must be >= 1")
        if not 0.0 <= remote_ttft_share <= 1.0:
            raise ValueError("remote_ttft_share must be between 0 and 1")
        self.perf = perf
        self.remote_ttft_share = remote_ttft_share
        self.chunk_tokens = chunk_tokens  # a local prefill's largest chunk per step (None: one step)
        self.itl_window_tokens = itl_window_tokens
        self.block_tokens = block_tokens  # a decode leg recomputes the prompt's last block (at most this)
        self.bindings = SessionBindings()

    def bind(self, job: PrefillJob, snapshot: PDSnapshot) -> str:
        bound = self.bindings.get(job.session_id)
        healthy = snapshot.healthy_decode() or snapshot.decode
        if bound in {w.id for w in healthy}:
            return bound
        if not healthy:
            raise ValueError("no decode worker")
        need = job.prompt_tokens + job.max_tokens
        fits = [w for w in healthy if w.kv_free_tokens >= need] or list(healthy)
        worker = max(fits, key=lambda w: (w.kv_headroom, -w.sequences, job.cached_on(w.id), w.id))
        self.bindings.bind(job.session_id, worker.id)
        return worker.id

    def estimate(self, job: PrefillJob, decode: WorkerLoad, snapshot: PDSnapshot) -> PrefillEstimate:
        perf = self.perf
        held = job.cached_on(decode.id)
        new = job.prompt_tokens - held
        chunk = new if self.chunk_tokens is None else min(new, self.chunk_tokens)
        model_step = perf.decode_step_time(decode.running, decode.context_tokens)
        base_step = max(model_step, decode.itl_recent_s or 0.0)
        # prefills already queued there join the same step (the token budget batches them together),
        # so the step the running sequences wait through holds their tokens as well as this chunk
        step_prefill = StepShape.prefill(chunk + decode.queued_prefill_tokens, held)
        with_prefill = perf.step_time(step_prefill + StepShape.decode(decode.running, decode.context_tokens))
        local_step = max(with_prefill, base_step)
        steps = max(1, -(-new // chunk)) if chunk else 1
        local_ttft = (
            perf.request_overhead_s + perf.prefill_time(decode.queued_prefill_tokens) + steps * local_step
        )
        local_itl, breaks = self._local_itl(
            decode, model_step, base_step, local_step, steps, snapshot.itl_slo_s
        )
        # the decode leg's first token: its step recomputes the last block beside the running batch
        tail = job.prompt_tokens % self.block_tokens or min(self.block_tokens, job.prompt_tokens)
        decode_first = perf.step_time(
            StepShape.prefill(tail, job.prompt_tokens - tail)
            + StepShape.decode(decode.running, decode.context_tokens)
        )
        best: tuple[float, str, float] | None = None
        for p in snapshot.healthy_prefill():
            on_p = job.cached_on(p.id)
            history_to_ship = max(0, held - on_p)  # what the decode worker has and the prefill worker lacks
            computed = job.uncached_on(p.id, decode.id)
            modelled = (
                perf.request_overhead_s
                + perf.prefill_time(p.prefill_backlog_tokens)
                + perf.transfer_time(history_to_ship)
                + perf.prefill_time(computed, max(on_p, held))
            )
            # its recent legs' observed pace scales the modelled one up, never down
            leg = modelled * max(1.0, p.leg_pace or 1.0)
            ttft = leg + perf.transfer_time(new) + perf.request_overhead_s + decode_first
            if best is None or (ttft, p.id) < best[:2]:
                best = (ttft, p.id, modelled)
        return PrefillEstimate(
            local_ttft,
            best[0] if best else float("inf"),
            local_step,
            local_itl,
            best[1] if best else None,
            breaks,
            best[2] if best else 0.0,
        )

    def _local_itl(
        self,
        decode: WorkerLoad,
        model_step: float,
        base_step: float,
        local_step: float,
        steps: int,
        itl_slo: float,
    ) -> tuple[float, int]:
        """The running sequences' gap with a local prefill's `steps` stretched steps in it, as the SLO
        takes it, and how many of them it takes past the SLO. The gap: every gap (a window of 1 token:
        the stretched step itself), else a mean. For a mean, with the worker's streams known: the worst
        final mean gap among those that would keep the SLO without it (one already past it is lost
        either way, one about to end takes few stretched gaps), and those it breaks are counted one by
        one. Whether a stream is lost is judged at the modelled step, its stretch at the observed one
        when slower: a gap the recent window shows stretched by prefills that are over does not write
        off the batch's streams (which would let every prefill through). Without them: the stretched
        steps spread over the window the SLO averages (all of it when they fill it), which breaks every
        running sequence or none. Streams seen only in part (other gateways' there too) take the worse
        of both."""
        window = self.itl_window_tokens
        windowed = base_step + min(steps, window) * (local_step - base_step) / window
        window_breaks = decode.running if windowed > itl_slo else 0
        if not decode.streams or window == 1:
            return windowed, window_breaks
        at_risk = [s for s in decode.streams if s.remaining and s.mean_gap_s(model_step) <= itl_slo]
        stretched = [s.mean_gap_s(base_step, steps, local_step) for s in at_risk]
        worst = max(stretched, default=base_step)
        breaks = sum(gap > itl_slo for gap in stretched)
        if len(decode.streams) >= decode.running:
            return worst, breaks
        return max(worst, windowed), max(breaks, window_breaks)

    def place(self, job: PrefillJob, snapshot: PDSnapshot) -> PDDecision:
        decode_id = self.bind(job, snapshot)
        decode = next(w for w in snapshot.decode if w.id == decode_id)
        est = self.estimate(job, decode, snapshot)
        if est.remote_worker is None:
            return PDDecision(decode_id, None, "no-prefill-worker", estimate=est)
        new = job.uncached_on(decode_id)
        ttft_slo = snapshot.ttft_slo_s
        # the requests each way that would miss their SLO: local, the running streams its stretched
        # steps break (an idle worker has none) and this one if it is late; remote, this one if late
        local_misses = est.local_itl_breaks + (est.local_ttft_s > ttft_slo)
        remote_misses = int(est.remote_ttft_s > ttft_slo)
        if local_misses != remote_misses:
            local = local_misses < remote_misses
        elif (
            not remote_misses
            and math.isfinite(ttft_slo)
            and est.remote_ttft_s <= self.remote_ttft_share * ttft_slo
        ):
            local = False  # the prefill pool has slack: the decode batch keeps its time
        else:
            local = est.local_ttft_s <= est.remote_ttft_s
        slack = "slack" if min(local_misses, remote_misses) == 0 else "least-violation"
        if local:
            return PDDecision(decode_id, None, f"local-{slack}", estimate=est)
        return PDDecision(decode_id, est.remote_worker, f"remote-{slack}", new, est)

    def forget_worker(self, worker: str) -> None:
        self.bindings.forget_worker(worker)


# every PD policy's name: its object's `name`, and what `pd.policy`, `tokenops plan-pd --policy` and
# `tokenops sim run --pd` take; `static` is the gateway's default, short for `static_pd_incremental`
PDPolicyName = Literal[
    "static",
    "static_pd",
    "static_pd_incremental",
    "conditional_dynamo",
    "conditional_llm_d",
    "ampd",
    "colocated",
]
PD_POLICY_NAMES: tuple[str, ...] = get_args(PDPolicyName)


def make_pd_policy(
    name: str,
    perf: PerfModel | None = None,
    *,
    max_local_prefill_length: int = 1000,
    max_prefill_queue_size: int = 2,
    non_cached_tokens: int = 256,
    itl_window_tokens: int = 1,
    remote_ttft_share: float = REMOTE_TTFT_SHARE,
) -> PDPolicy:
    """The PD policy `name` (`PD_POLICY_NAMES`) with its options: Dynamo's and llm-d's thresholds
    (the defaults are what Dynamo ships and llm-d's guides set), and for AMPD, which needs `perf`,
    its ITL window and its tie-break's share of the TTFT SLO. `ValueError` for an unknown name,
    listing the valid ones."""
    if name in ("static", "static_pd_incremental"):
        return StaticPD(perf, incremental=True)  # the prefill worker pulls the history from the decode worker
    if name == "static_pd":
        return StaticPD(perf)  # as vLLM ships it: the prefill worker recomputes the history its cache lacks
    if name == "conditional_dynamo":
        return ConditionalPD.dynamo(max_local_prefill_length, max_prefill_queue_size)
    if name == "conditional_llm_d":
        return ConditionalPD.llm_d(non_cached_tokens)
    if name == "ampd":
        if perf is None:
            raise ValueError("PD policy ampd weighs modelled costs: it needs a PerfModel")
        return AMPD(perf, itl_window_tokens=itl_window_tokens, remote_ttft_share=remote_ttft_share)
    if name == "colocated":
        return Colocated()
    raise ValueError(f"unknown PD policy {name!r}: use one of {', '.join(PD_POLICY_NAMES)}")
