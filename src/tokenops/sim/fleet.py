"""The simulated fleet: sessions arrive, the gateway admits and places each request with the live
cluster's own policy objects, replicas run it through the engine model, and every request ends as the
bench's `RequestRecord`, so `tokenops.bench.metrics` summarises a simulated run exactly as a live one.

Placement mirrors the live pool (`cluster.pool.ReplicaPool.acquire`): a snapshot of the replicas with a
free concurrency slot, built as `Replica.state()` builds it (the gateway's in-flight counts, the
replica's load report as last polled), handed to a balancing `Policy`; with no free slot the request
waits at the gateway, first come first served, or is refused past `max_queued`. With a PD policy the
fleet builds a `PDSnapshot` instead, and a remote prefill ships its KV to the decode replica after the
`PerfModel`'s transfer time (transfers do not contend for bandwidth), begun at once, as the live KV
server begins a pull of held blocks while its engine steps (a history pull by hash from the decode
worker begins between that worker's steps, where the live server pins cached blocks); as on the live
path, the decode worker produces every token, the first after its own step over the prompt's last block.
With `prefill_slots` a prefill worker runs that many legs at a time and the rest wait at the gateway,
first come first served or in the worker's `PrefillQueue` order (the live prefill gate's policy object),
counted in the PD snapshot as the live dispatch counts them; with `prefill_wait_s` a leg whose wait runs
out is withdrawn and its decode worker prefills the request, as live. This module owns the wiring and
the bookkeeping; the engines' scheduling is engine_model.py's, the clock events.py's.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenops.bench.metrics import SLO, Pricing, RequestRecord, summarize
from tokenops.cluster.pd import LegPace, PDDecision, PDPolicy, PDSnapshot, PrefillJob, WorkerLoad
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import Decision, Policy, RoundRobin
from tokenops.cluster.prefill_backlog import LegBlocks, PrefillBacklog, leg_blocks
from tokenops.cluster.prefill_queue import PrefillQueue
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, ReportedLoad, RequestInfo
from tokenops.sim.engine_model import EngineShape, ReplicaEngine, SimRequest
from tokenops.sim.events import EventLoop
from tokenops.sim.workload import SimSession


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A fleet of one replica type (plus, with PD, a prefill pool of its own type)."""

    perf: PerfModel
    engine: EngineShape = field(default_factory=EngineShape)
    replicas: int = 1  # colocated workers, or the decode pool under a PD policy
    prefill_replicas: int = 0  # the prefill pool (PD only)
    prefill_perf: PerfModel | None = None  # default: `perf`
    prefill_engine: EngineShape | None = None  # default: `engine`
    concurrency_limit: int | None = None  # per replica, as the pool's limiter; None: unlimited
    max_queued: int | None = None  # requests waiting at the gateway beyond which it refuses (429)
    poll_interval_s: float | None = 1.0  # load reports refresh (the load poller); None: never polled
    exact_index: bool = False  # feed the policy's prefix index from the engines' stores and evictions
    model: str = "sim"
    ttft_slo_s: float = float("inf")  # what a PD snapshot carries for SLO-aware policies
    itl_slo_s: float = float("inf")
    sample_every_s: float = 1.0  # KV occupancy timeline resolution
    # replicas sharing one host's cores (CPU engines): a step's slowdown per other replica with work
    # (`calibrate.measure_contention`); 0 for replicas on their own accelerators
    host_contention: float = 0.0
    # PD: prefill legs under way per prefill worker (the prefill pool's concurrency limit; None:
    # unlimited, every leg goes straight to the worker's engine). Legs beyond it wait at the gateway,
    # first come first served, or with `prefill_queue` in the worker's `PrefillQueue` order (the live
    # `PrefillGate`'s, `pd.prefill_queue`), weighing prefill times by `prefill_perf` against `ttft_slo_s`
    prefill_slots: int | None = None
    prefill_queue: bool = False
    prefill_lookahead: int = 5
    prefill_max_deferrals: int = 3
    # how long a leg waits at the gateway for a slot before it gives up and the decode worker prefills
    # the request itself, as the live dispatch's wait (the request's `max_wait`, else the prefill
    # pool's `queue_timeout_s`, 30 s by default) ends; None: a leg waits as long as it takes
    prefill_wait_s: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.prefill_replicas < 0:
            raise ValueError("prefill_replicas must be >= 0")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError("concurrency_limit must be >= 1")
        if self.host_contention < 0:
            raise ValueError("host_contention must be >= 0")
        if self.prefill_slots is not None and self.prefill_slots < 1:
            raise ValueError("prefill_slots must be >= 1")
        if self.prefill_queue and self.prefill_slots is None:
            raise ValueError("prefill_queue orders legs waiting for a slot: set prefill_slots")
        if self.prefill_wait_s is not None and self.prefill_wait_s < 0:
            raise ValueError("prefill_wait_s must be >= 0")


@dataclass
class SimResult:
    """A finished run: the records the bench's metrics read, and per-replica accounting."""

    records: list[RequestRecord]
    duration_s: float
    replicas: dict[str, dict[str, Any]]
    kv_timeline: dict[str, list[tuple[float, float, int]]]
    decisions: list[tuple[Any, Any, Any]]
    wall_s: float
    events: int

    def summary(self, slo: SLO | None = None, pricing: Pricing | None = None) -> dict[str, Any]:
        out = summarize(self.records, self.duration_s, slo=slo, pricing=pricing)
        out["replica_stats"] = self.replicas
        out["sim"] = {
            "wall_s": self.wall_s,
            "events": self.events,
            "requests_per_wall_s": len(self.records) / self.wall_s if self.wall_s else None,
        }
        return out


class Fleet:
    """Build once per run: `Fleet(config, policy=..., pd_policy=...).run(sessions)`.

    `policy` is any balancing `Policy` (default round robin); `pd_policy` any `PDPolicy` and, when
    given, places every request instead. With `record_decisions` every (input, snapshot, decision)
    the policy saw is kept, for the policy-sharing test and for debugging a placement.
    """

    def __init__(
        self,
        config: FleetConfig,
        policy: Policy | None = None,
        pd_policy: PDPolicy | None = None,
        *,
        record_decisions: bool = False,
    ) -> None:
        self.config = config
        self.policy = policy if policy is not None else RoundRobin()
        self.pd_policy = pd_policy
        self.record_decisions = record_decisions
        self.loop = EventLoop()
        index = getattr(self.policy, "index", None) if config.exact_index else None
        if config.exact_index and index is None:
            raise ValueError(f"exact_index needs a policy with a prefix index, not {self.policy.name}")
        if config.exact_index and getattr(self.policy, "learn", False):
            raise ValueError("exact_index needs the policy built with learn=False")
        role = "decode" if pd_policy is not None and config.prefill_replicas else "both"
        prefix = "d" if role == "decode" else "r"
        self.workers = [
            ReplicaEngine(
                f"{prefix}{i}", config.perf, config.engine, self.loop, self._finished, role=role,
                index=index, sample_every_s=config.sample_every_s, host_contention=config.host_contention,
            )
            for i in range(config.replicas)
        ]  # fmt: skip
        self.prefill_workers = [
            ReplicaEngine(
                f"p{i}", config.prefill_perf or config.perf, config.prefill_engine or config.engine,
                self.loop, self._finished, self._prefilled, role="prefill",
                sample_every_s=config.sample_every_s, host_contention=config.host_contention,
            )
            for i in range(config.prefill_replicas if pd_policy is not None else 0)
        ]  # fmt: skip
        if config.host_contention:
            everyone = self.workers + self.prefill_workers
            for w in everyone:
                w.neighbours = [o for o in everyone if o is not w]
        self.by_id = {w.id: w for w in self.workers + self.prefill_workers}
        # as the engine's scheduler, a sequence may not outgrow a worker's KV pool (it could never
        # be resumed after a preemption): a longer prompt is refused, an answer ends at the pool's size
        self._window = min(w.total_blocks * w.bs for w in self.by_id.values())
        # per worker the requests placed there until they finish (the gateway's leases): requests,
        # prompt tokens, max_tokens
        self._in_flight = {w.id: [0, 0, 0] for w in self.workers}
        self._reported: dict[str, ReportedLoad | None] = {w.id: None for w in self.workers}
        self._states: dict[str, ReplicaState] = {}
        self._dirty = {w.id for w in self.workers}
        self._position = {w.id: i for i, w in enumerate(self.workers)}
        self._state_list = [self._state(w) for w in self.workers]
        self._queue: deque[SimRequest] = deque()
        # PD prefill legs: those under way per prefill worker, and the blocks of those waiting for one
        # of its slots and of those under way there (as the live snapshot counts them)
        self._legs = {w.id: 0 for w in self.prefill_workers}
        self._backlog = {w.id: PrefillBacklog(w.bs) for w in self.prefill_workers}
        self._leg_requests: dict[str, SimRequest] = {}  # a waiting leg's job id -> its request
        # as the live gateway keeps it: each prefill worker's recent legs, observed against the time
        # the policy modelled for them; per leg under way, when it was placed and its modelled time
        self._pace = {w.id: LegPace() for w in self.prefill_workers}
        self._leg_model: dict[int, tuple[float, float]] = {}
        # the live gateway's own counts (`PDRoute.prefilling`, the leases in flight), which its
        # snapshot puts over the engines' reports: per worker the prefills placed there and not yet
        # answered (a local one until its first token, a remote leg until its KV is ready), by
        # request id with the prompt tokens that worker lacked, beside `_in_flight`. A request on
        # its way to an engine, or in its inbox between steps, is in no engine's state yet but is in
        # these.
        self._under_way: dict[str, dict[int, tuple[SimRequest, int]]] = {
            w.id: {} for w in self.workers + self.prefill_workers
        }
        self.prefill_queues: dict[str, PrefillQueue | deque[PrefillJob]] = {
            w.id: PrefillQueue(
                config.prefill_perf or config.perf, config.ttft_slo_s, worker=w.id,
                lookahead=config.prefill_lookahead, max_deferrals=config.prefill_max_deferrals,
            ) if config.prefill_queue else deque()
            for w in self.prefill_workers
        }  # fmt: skip
        # (time, worker, job id) of each leg let through after waiting, and of each whose wait ran out
        # (its request prefilled on its decode worker), for tests and debugging
        self.leg_releases: list[tuple[float, str, str]] = []
        self.leg_timeouts: list[tuple[float, str, str]] = []
        self._sessions: dict[str, tuple[SimSession, int]] = {}
        self.records: list[RequestRecord] = []
        self.decisions: list[tuple[Any, Any, Any]] = []
        self._next_id = 0
        self._outstanding = 0

    # -- the run -------------------------------------------------------------------------------------

    def run(self, sessions: Sequence[SimSession], until: float = float("inf")) -> SimResult:
        wall = time.perf_counter()
        self.loop.at_each((s.arrival_s, self._arrive, (s, 0)) for s in sessions)
        if self.config.poll_interval_s is not None and self.pd_policy is None:
            self.loop.at(0.0, self._poll, None)
        # what a run allocates lives till its end (records) or dies by reference count (events): the
        # cyclic collector's passes over the growing records would be a quarter of the run, for nothing
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run(until)
        finally:
            if collecting:
                gc.enable()
        wall = time.perf_counter() - wall
        start = min((r.start for r in self.records), default=0.0)
        end = max((r.end for r in self.records), default=0.0)
        duration = max(end - start, 1e-9)
        stats = {}
        for w in self.workers + self.prefill_workers:
            stats[w.id] = {
                "role": w.role,
                "utilisation": w.utilisation(duration),
                "mean_kv_usage": w.mean_kv_usage(),
                "steps": w.steps,
                "preemptions": w.preemptions,
                "prefill_tokens": w.prefill_tokens,
                "decode_tokens": w.decode_tokens,
            }
        return SimResult(
            self.records, duration, stats, {w.id: w.kv_timeline for w in self.by_id.values()},
            self.decisions, wall, self.loop.events_run,
        )  # fmt: skip

    def _arrive(self, arg: tuple[SimSession, int]) -> None:
        session, k = arg
        rnd = session.rounds[k]
        self._next_id += 1
        r = SimRequest(
            self._next_id, self.loop.now, rnd.prompt_tokens, rnd.max_tokens, rnd.hashes,
            rnd.cache_hashes, session.session_id, k,
        )  # fmt: skip
        self._sessions[session.session_id] = (session, k)
        self._outstanding += 1
        if r.prompt_tokens >= self._window:
            self._refuse(r, "400 the prompt does not fit the context window")
            return
        r.max_tokens = min(r.max_tokens, self._window - r.prompt_tokens)
        if self.pd_policy is not None:
            self._place_pd(r)
        elif self._queue or not self._place(r):
            if self.config.max_queued is not None and len(self._queue) >= self.config.max_queued:
                self._refuse(r, "429 gateway queue full")
            else:
                self._queue.append(r)

    # -- balancing (colocated) -------------------------------------------------------------------

    def _state(self, w: ReplicaEngine) -> ReplicaState:
        if w.id in self._dirty:
            n, p, o = self._in_flight[w.id]
            self._states[w.id] = ReplicaState(
                w.id, w.id, 1.0, n, p, o, self.config.concurrency_limit, self._reported[w.id],
                self.config.poll_interval_s is not None,
            )  # fmt: skip
            self._dirty.discard(w.id)
        return self._states[w.id]

    def _place(self, r: SimRequest) -> bool:
        config = self.config
        limit = config.concurrency_limit
        if self._dirty:
            for rid in tuple(self._dirty):
                self._state_list[self._position[rid]] = self._state(self.by_id[rid])
        if limit is None:
            states = tuple(self._state_list)
        else:
            states = tuple(s for s in self._state_list if s.in_flight < limit)
            if not states:
                return False
        info = RequestInfo(
            config.model, r.session_id, r.hashes, config.engine.block_size, r.prompt_tokens, r.max_tokens
        )
        snap = PoolSnapshot(states, now=self.loop.now)
        decision: Decision = self.policy.choose(info, snap)
        if self.record_decisions:
            self.decisions.append((info, snap, decision))
        self._lease(decision.replica, r, 1)
        self._dirty.add(decision.replica)
        r.reason = decision.reason
        self._enqueue(self.by_id[decision.replica], r)
        return True

    def _enqueue(self, w: ReplicaEngine, r: SimRequest, kv: Sequence[int] = ()) -> None:
        overhead = w.perf.request_overhead_s
        if overhead:
            self.loop.after(overhead, self._enter, (w, r, kv))
        else:
            self._enter((w, r, kv))

    def _enter(self, arg: tuple[ReplicaEngine, SimRequest, Sequence[int]]) -> None:
        w, r, kv = arg
        w.add(r, kv)

    def _poll(self, _: object) -> None:
        now = self.loop.now
        for w in self.workers:
            self._reported[w.id] = ReportedLoad(w.running, w.queued, w.kv_usage(), now)
            self._dirty.add(w.id)
        if self._outstanding or len(self.loop):
            self.loop.after(self.config.poll_interval_s, self._poll, None)

    # -- PD -------------------------------------------------------------------------------------------

    def _load(self, w: ReplicaEngine) -> WorkerLoad:
        """As `PDRoute._load` builds it: the gateway's counts, or the worker's own state (the live
        load report, fresh here) where that is larger; for the prompt tokens, which no live report
        carries, the worker's own figure too (what it still has to compute, preempted work included)."""
        backlog = self._backlog.get(w.id)
        legs, tokens = (backlog.legs, backlog.tokens) if backlog else (0, 0)
        under_way = self._under_way[w.id]
        for rid in [rid for rid, (r, _) in under_way.items() if r.generated]:
            del under_way[rid]  # a local prefill counts until its first token
        jobs, tokens_under_way = len(under_way), sum(n for _, n in under_way.values())
        placed = self._in_flight[w.id][0] if w.id in self._in_flight else 0  # decode workers only
        return WorkerLoad(
            w.id, w.role, max(jobs, w.queued), max(tokens_under_way, w.prefill_backlog()),
            max(w.running, placed - jobs), w.context_tokens(),
            w.available_blocks() * w.bs, w.total_blocks * w.bs,
            self._pace[w.id].value(self.loop.now) if w.id in self._pace else None, w.last_itl_s,
            waiting_legs=legs, waiting_prefill_tokens=tokens,
            streams=w.streams() if w.role != "prefill" else (),
        )  # fmt: skip

    def _place_pd(self, r: SimRequest) -> None:
        now = self.loop.now
        cached = {}
        for w in self.workers + self.prefill_workers:
            n = w.cached_prefix_blocks(r.hashes)
            if n:
                cached[w.id] = n * w.bs
        job = PrefillJob(str(r.id), r.prompt_tokens, r.session_id, r.round, cached, r.max_tokens, r.arrival)
        snap = PDSnapshot(
            tuple(self._load(w) for w in self.prefill_workers),
            tuple(self._load(w) for w in self.workers),
            now, self.config.ttft_slo_s, self.config.itl_slo_s,
        )  # fmt: skip
        decision: PDDecision = self.pd_policy.place(job, snap)  # type: ignore[union-attr]
        if self.record_decisions:
            self.decisions.append((job, snap, decision))
        r.reason = decision.reason
        r.decode_replica = decision.decode
        self._lease(decision.decode, r, 1)
        if decision.prefill is None:
            self._under_way[decision.decode][r.id] = (r, job.uncached_on(decision.decode))
            self._enqueue(self.by_id[decision.decode], r)
            return
        r.prefill_only = True
        r.prefill_replica = decision.prefill
        r.transfer_tokens = decision.transfer_tokens
        if decision.estimate is not None:
            self._leg_model[r.id] = (now, decision.estimate.remote_leg_s)
        limit = self.config.prefill_slots
        if limit is not None and self._legs[decision.prefill] >= limit:
            # every slot of the worker is taken: the leg waits at the gateway for one
            self._leg_requests[job.request_id] = r
            waiting = self.prefill_queues[decision.prefill]
            if isinstance(waiting, PrefillQueue):
                waiting.push(job)
            else:
                waiting.append(job)
            self._backlog[decision.prefill].wait(self._leg_blocks(decision.prefill, job, r))
            if self.config.prefill_wait_s is not None:
                self.loop.after(self.config.prefill_wait_s, self._wait_ran_out, job)
            return
        self._start_leg(r, job)

    def _unwait(self, worker: str, job: PrefillJob) -> SimRequest:
        """A waiting leg leaves the gateway's line (let through, or its wait ran out): its request."""
        r = self._leg_requests.pop(job.request_id)
        self._backlog[worker].unwait(self._leg_blocks(worker, job, r))
        return r

    def _leg_blocks(self, worker: str, job: PrefillJob, r: SimRequest) -> LegBlocks:
        return leg_blocks(r.hashes, job.prompt_tokens, job.cached_on(worker), self.by_id[worker].bs)

    def _wait_ran_out(self, job: PrefillJob) -> None:
        """As the live dispatch when a leg's wait for a slot runs out: the leg is withdrawn unsent and
        the decode worker prefills the request itself (a request of its own: its overhead again)."""
        r = self._leg_requests.get(job.request_id)
        if r is None:
            return  # let through before its wait ran out
        worker = r.prefill_replica
        assert worker is not None
        queue = self.prefill_queues[worker]
        if isinstance(queue, PrefillQueue):
            queue.discard(job)
        else:
            queue.remove(job)
        self._unwait(worker, job)
        self._leg_model.pop(r.id, None)
        self.leg_timeouts.append((self.loop.now, worker, job.request_id))
        r.prefill_only = False
        r.prefill_replica = None
        r.transfer_tokens = 0
        self._under_way[r.decode_replica][r.id] = (r, job.uncached_on(r.decode_replica))
        self._enqueue(self.by_id[r.decode_replica], r)

    def _start_leg(self, r: SimRequest, job: PrefillJob) -> None:
        """A prefill leg takes a slot of its worker and goes: the history its worker lacks travels
        there first (within the leg, as the live prefill engine pulls it), then the prompt is queued."""
        assert r.prefill_replica is not None
        self._legs[r.prefill_replica] += 1
        # a decision that ships back only what the decode worker lacks has the leg work on its history
        pulls = r.transfer_tokens < r.prompt_tokens
        history = r.decode_replica if pulls else None
        self._under_way[r.prefill_replica][r.id] = (r, job.uncached_on(r.prefill_replica, history))
        self._backlog[r.prefill_replica].start(r.hashes)
        prefill, decode = self.by_id[r.prefill_replica], self.by_id[r.decode_replica]
        held = decode.cached_prefix_blocks(r.hashes)
        lacks = held - prefill.cached_prefix_blocks(r.hashes)
        if pulls and lacks > 0:
            # the history the prefill worker lacks travels there first instead of being recomputed
            decode.pin_for_peer(r, r.hashes[held - lacks : held])  # its KV server pins what it sends
            done = self._pulled_at(decode, lacks * decode.bs)
            self.loop.at(done, self._history_arrived, (prefill, decode, r, held))
            return
        self._enqueue(prefill, r)

    def _history_arrived(self, arg: tuple[ReplicaEngine, ReplicaEngine, SimRequest, int]) -> None:
        prefill, decode, r, held = arg
        decode.unpin_for_peer(r)
        self._enqueue(prefill, r, r.hashes[:held])  # imported as the leg is added

    def _prefilled(self, r: SimRequest) -> None:
        # the decode leg is a request of its own: its overhead, the pull, then the decode worker's step
        r.prefill_only = False
        self.loop.after(self.by_id[r.decode_replica].perf.request_overhead_s, self._pull, r)
        if r.prefill_replica is not None:
            del self._under_way[r.prefill_replica][r.id]
            placed = self._leg_model.pop(r.id, None)
            if placed is not None:  # the live gateway's observation when the leg answers
                now = self.loop.now
                self._pace[r.prefill_replica].observe(now, now - placed[0], placed[1])
            backlog = self._backlog[r.prefill_replica]
            backlog.hold(r.hashes)
            backlog.finish(r.hashes)
        self._end_leg(r.prefill_replica)

    def _end_leg(self, worker: str | None) -> None:
        """A leg answered: its slot goes to the next waiting leg, in the worker's queue order."""
        if worker is None:
            return
        self._legs[worker] -= 1
        waiting = self.prefill_queues[worker]
        limit = self.config.prefill_slots
        while waiting and limit is not None and self._legs[worker] < limit:
            if isinstance(waiting, PrefillQueue):
                job = waiting.pop(self.loop.now)
                assert job is not None
            else:
                job = waiting.popleft()
            self.leg_releases.append((self.loop.now, worker, job.request_id))
            self._start_leg(self._unwait(worker, job), job)

    def _pull(self, r: SimRequest) -> None:
        # the prefill worker's KV server begins a pull of held blocks at once, while its engine steps;
        # a decode worker without a prefix cache pulls nothing (it has nowhere to put the blocks)
        decode = self.by_id[r.decode_replica]
        done = self.loop.now + (self.config.perf.transfer_time(r.transfer_tokens) if decode.caching else 0.0)
        self.loop.at(done, self._pulled, r)

    def _pulled(self, r: SimRequest) -> None:
        # the pull has landed: the prefill worker's hold ends, and the decode leg joins its worker
        assert r.prefill_replica is not None and r.decode_replica is not None
        self.by_id[r.prefill_replica].unpin_for_peer(r)
        self.by_id[r.decode_replica].add_decode(r)

    def _pulled_at(self, source: ReplicaEngine, tokens: int) -> float:
        """When a pull of `tokens` of cached KV by hash from `source`, asked for now, has landed. The
        source's KV server pins cached blocks on its engine's thread, between steps: a pull that
        arrives while the source is stepping begins when that step ends, then takes the transfer
        time."""
        if tokens <= 0:
            return self.loop.now
        return max(self.loop.now, source.step_ends) + self.config.perf.transfer_time(tokens)

    # -- completion -----------------------------------------------------------------------------------

    def _finished(self, r: SimRequest) -> None:
        now = self.loop.now
        cached = max(r.cached_tokens, 0)
        self.records.append(
            RequestRecord(
                start=r.arrival, end=now, chunk_times=r.token_times, first_byte=r.token_times[0],
                prompt_tokens=r.prompt_tokens, output_tokens=r.generated, cached_tokens=cached,
                session_id=r.session_id, round=r.round,
            )
        )  # fmt: skip
        self._outstanding -= 1
        if self.pd_policy is not None:
            self._lease(r.decode_replica, r, -1)
        elif r.replica in self._in_flight:
            self._lease(r.replica, r, -1)
            self._dirty.add(r.replica)
            while self._queue and self._place(self._queue[0]):
                self._queue.popleft()
        self._next_round(r)

    def _lease(self, worker: str, r: SimRequest, sign: int) -> None:
        """r placed on `worker` (+1) or done there (-1), in its in-flight counts."""
        f = self._in_flight[worker]
        f[0] += sign
        f[1] += sign * r.prompt_tokens
        f[2] += sign * r.max_tokens

    def _refuse(self, r: SimRequest, error: str) -> None:
        now = self.loop.now
        self.records.append(
            RequestRecord(start=r.arrival, end=now, success=False, error=error,
                          prompt_tokens=r.prompt_tokens, session_id=r.session_id, round=r.round)
        )  # fmt: skip
        self._outstanding -= 1
        self._next_round(r)

    def _next_round(self, r: SimRequest) -> None:
        session, k = self._sessions[r.session_id]
        if k + 1 < len(session.rounds):
            self.loop.after(session.rounds[k + 1].delay_s, self._arrive, (session, k + 1))
        else:
            del self._sessions[r.session_id]
