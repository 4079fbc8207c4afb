"""A PD model's placement inside the cluster's dispatch: the PD policy's decision over the model's
decode pool (its replica pool) and its prefill pool, and the bodies of the two legs of vLLM's
disaggregated-prefill contract.

`Cluster.open` sends a PD model's request like any other (concurrency slots, the wait for one, breakers,
retries before the first byte), except that the decode replica is chosen by `PDRoute`'s chooser, which
hands the PD policy a `PDSnapshot` built from both pools: only replicas whose breaker admits traffic,
their load as polled plus this gateway's own in-flight prefills and the prefill legs waiting here for a
worker's slots, and the prompt tokens each holds according to the pool's prefix index. When the policy
places the prefill remotely, the prefill leg (`kv_transfer_params: {do_remote_decode: true}`,
`max_tokens: 1`, plus the bound decode engine as `history` from a session's second round on unless
the decision says otherwise, so the prefill engine pulls the history it lacks instead of recomputing
it) runs on a slot of the prefill pool
first (with a `PrefillGate`, legs waiting for a worker's slots are released in `PrefillQueue` order); one
that fails or finds no slot within its wait (the request's `max_wait`, else the prefill pool's
`queue_timeout`) leaves the decode replica to prefill itself. A prefix index that learns from the
dispatch credits a worker with the prompt once its leg answered. This module does not choose (the policy
does), does not move KV (the engines do) and does not speak HTTP (the dispatch does).
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenops.cluster.pd import (
    LegPace,
    PDDecision,
    PDPolicy,
    PDSnapshot,
    PrefillJob,
    StreamProgress,
    WindowedRatio,
    WorkerLoad,
    make_pd_policy,
)
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.policies import Decision
from tokenops.cluster.pool import Chooser, Lease, PoolOverloaded, PoolUnavailable, ReplicaPool
from tokenops.cluster.prefill_backlog import PrefillBacklog, leg_blocks
from tokenops.cluster.prefill_queue import PrefillQueue
from tokenops.cluster.session_rounds import LocalSessionRounds, SessionRounds, SessionTurn
from tokenops.cluster.snapshot import PoolSnapshot, ReplicaState, RequestInfo


@dataclass(slots=True)
class PDPlacement:
    """What the PD path did for one request: the session round and its shared binding, the job and
    decision its answer came from, and the prefill leg sent for it (worker, status, its
    `prompt_token_sources`, `kv_transfer`); the legs of tries whose decode replica failed before
    answering are in `passed_over`, not billed."""

    round: int
    bound: str | None = None  # the decode worker the session is bound to across gateways, if shared
    arrived_at: float = 0.0  # when the gateway started placing it (monotonic clock): the job's arrival
    job: PrefillJob | None = None
    decision: PDDecision | None = None
    legs: list[dict[str, Any]] = field(default_factory=list)
    passed_over: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prefill_computed(self) -> int:
        """Prompt tokens the prefill leg computed (0 when the decode replica prefilled itself)."""
        return sum(leg.get("computed", 0) for leg in self.legs)


class ItlWindow(WindowedRatio):
    """The mean inter-token gap of a decode worker's streams over the last `window_s` seconds, as the
    gateway relayed them (every stream's gaps pooled, each weighted by the tokens it covers); None
    when no token arrived in the window."""

    def __init__(self, window_s: float = 2.0) -> None:
        super().__init__(window_s)

    def observe(self, now: float, seconds: float, tokens: int = 1) -> None:
        """`tokens` arrived `seconds` after the stream's previous ones, at `now`."""
        super().observe(now, seconds, tokens)


class StreamGaps:
    """One relayed stream's side of a decode worker's `ItlWindow`: the gaps between its SSE data
    events, as a client sees them. The wait before the first event is the stream's TTFT, not a gap;
    events that arrive in one chunk came at once, so a chunk of k events after an earlier one adds k
    gaps over the time since it, and the first chunk adds k - 1 gaps of no time. While the stream is
    under way it is in its worker's `live` set, where the snapshot reads its `progress` (a closing
    usage-only event counts as one more token)."""

    __slots__ = ("_elapsed", "_gaps", "_last", "_live", "_max_tokens", "_tokens", "_window", "__weakref__")

    def __init__(
        self, window: ItlWindow, max_tokens: int = 0, live: weakref.WeakSet[StreamGaps] | None = None
    ) -> None:
        self._window = window
        self._last: float | None = None
        self._max_tokens = max_tokens  # 0: unknown
        self._tokens = self._gaps = 0
        self._elapsed = 0.0
        self._live = live  # its decode worker's streams under way, which it leaves on `close`
        if live is not None:
            live.add(self)

    def relayed(self, chunk: bytes) -> None:
        tokens = chunk.count(b"data: {")
        if tokens:
            now = time.monotonic()
            if self._last is None:
                if tokens > 1:
                    self._window.observe(now, 0.0, tokens - 1)
                self._gaps += tokens - 1
            else:
                self._window.observe(now, now - self._last, tokens)
                self._gaps += tokens
                self._elapsed += now - self._last
            self._tokens += tokens
            self._last = now

    def progress(self) -> StreamProgress | None:
        """How far the stream has come (None when its length is unknown)."""
        if not self._max_tokens:
            return None
        return StreamProgress(self._gaps, self._elapsed, max(0, self._max_tokens - self._tokens))

    def close(self) -> None:
        if self._live is not None:
            self._live.discard(self)
            self._live = None


class PrefillGate:
    """The gateway's waiting line for each prefill worker's slots: a prefill leg whose worker already
    has its concurrency limit's worth of legs under way waits here, and each freed slot goes to the
    leg that worker's `PrefillQueue` picks (the least TTFT slack among those that can still meet the
    SLO, the shortest when none can, a leg passed over `max_deferrals` times next) rather than to the
    first in line. Legs wait here instead of in the prefill pool's own line, which serves the whole
    pool first come first served."""

    def __init__(
        self,
        perf: PerfModel,
        ttft_slo_s: float,
        *,
        lookahead: int = 5,
        max_deferrals: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.perf, self.ttft_slo_s = perf, ttft_slo_s
        self.lookahead, self.max_deferrals = lookahead, max_deferrals
        self.clock = clock
        self._queues: dict[str, PrefillQueue] = {}
        self._running: collections.Counter[str] = collections.Counter()  # legs let through, per worker
        self._turns: dict[int, asyncio.Future[None]] = {}  # id(job) -> its turn, while it waits

    def waiting(self, worker: str) -> int:
        queue = self._queues.get(worker)
        return len(queue) if queue is not None else 0

    @asynccontextmanager
    async def turn(
        self, worker: str, job: PrefillJob, limit: Callable[[], int], max_wait: float
    ) -> AsyncIterator[None]:
        """Hold one of `worker`'s `limit()` slots for the block, waiting (at most `max_wait` seconds,
        then `PoolOverloaded`) for the queue to pick `job` when they are all taken."""
        queue = self._queues.get(worker)
        if queue is None:
            queue = self._queues[worker] = PrefillQueue(
                self.perf,
                self.ttft_slo_s,
                worker=worker,
                lookahead=self.lookahead,
                max_deferrals=self.max_deferrals,
            )
        if not len(queue) and self._running[worker] < limit():
            self._running[worker] += 1
        else:
            turn = self._turns[id(job)] = asyncio.get_running_loop().create_future()
            queue.push(job)
            try:
                await asyncio.wait({turn}, timeout=max_wait)
            except BaseException:
                if not turn.done():
                    self._withdraw(queue, job)
                else:
                    self._leave(worker, limit)
                raise
            if not turn.done():
                self._withdraw(queue, job)
                raise PoolOverloaded(f"no slot of prefill worker {worker} within {max_wait:g} s")
        try:
            yield
        finally:
            self._leave(worker, limit)

    def _withdraw(self, queue: PrefillQueue, job: PrefillJob) -> None:
        queue.discard(job)
        del self._turns[id(job)]

    def _leave(self, worker: str, limit: Callable[[], int]) -> None:
        """A leg let through is done: hand the freed slots to the legs the queue picks."""
        self._running[worker] -= 1
        queue = self._queues[worker]
        while len(queue) and self._running[worker] < limit():
            job = queue.pop(self.clock())
            assert job is not None
            self._running[worker] += 1
            self._turns.pop(id(job)).set_result(None)


class PDRoute:
    """One PD model: its policy, its prefill pool (the decode pool is the model's own pool), the
    session round counts and the SLOs the policy weighs."""

    def __init__(
        self,
        policy: PDPolicy,
        prefill: ReplicaPool | None,
        *,
        rounds: SessionRounds | None = None,
        ttft_slo_s: float = float("inf"),
        itl_slo_s: float = float("inf"),
        gate: PrefillGate | None = None,
    ) -> None:
        self.policy = policy
        self.prefill = prefill
        self.gate = gate  # None: prefill legs wait in the prefill pool's line, first come first served
        self.rounds = rounds or LocalSessionRounds()
        self.ttft_slo_s, self.itl_slo_s = ttft_slo_s, itl_slo_s
        # prefills this gateway has under way per worker (remote legs and local ones until the first
        # byte): the freshest queue a policy can see, where a polled report lags by its interval
        self._prefill_jobs: collections.Counter[str] = collections.Counter()
        self._prefill_tokens: collections.Counter[str] = collections.Counter()
        # prefill legs bound to a worker and waiting here for one of its slots (the gate's line, or
        # the prefill pool's): work ahead of a new leg there that no load report shows yet; the legs
        # under way there are in it too, by their blocks only, as what the waiting ones need not compute
        self._backlog: dict[str, PrefillBacklog] = {}
        # each decode worker's inter-token gaps as this gateway relays its streams, and its streams
        # under way (placed there, until the answer is done): how far each has come
        self._itl: dict[str, ItlWindow] = {}
        # each prefill worker's recent legs, observed against modelled time (AMPD's remote estimate)
        self._pace: dict[str, LegPace] = {}
        self._streams: dict[str, weakref.WeakSet[StreamGaps]] = {}

    def stream_gaps(self, replica: str, max_tokens: int = 0) -> StreamGaps:
        """The recorder for a stream from decode worker `replica` of at most `max_tokens` tokens (0:
        unknown); it counts as under way there until `close`d."""
        window = self._itl.get(replica)
        if window is None:
            window = self._itl[replica] = ItlWindow()
        return StreamGaps(window, max_tokens, self._streams.setdefault(replica, weakref.WeakSet()))

    def streams(self, replica: str) -> tuple[StreamProgress, ...]:
        """The streams under way from `replica` whose length is known, as far as each has come."""
        progress = (g.progress() for g in list(self._streams.get(replica, ())))
        return tuple(p for p in progress if p is not None)

    def leg_answered(self, replica: str, observed_s: float, modelled_s: float) -> None:
        """A prefill leg on `replica` answered `observed_s` after it asked for a slot, where the policy
        had modelled `modelled_s` (0: it modelled none, as the rule-based policies). A leg that fails
        is not reported: the simulator has no failed legs to weigh it against."""
        pace = self._pace.get(replica)
        if pace is None:
            pace = self._pace[replica] = LegPace()
        pace.observe(time.monotonic(), observed_s, modelled_s)

    def leg_pace(self, replica: str) -> float | None:
        pace = self._pace.get(replica)
        return None if pace is None else pace.value(time.monotonic())

    def itl_recent_s(self, replica: str) -> float | None:
        window = self._itl.get(replica)
        return None if window is None else window.value(time.monotonic())

    def _load(
        self,
        state: ReplicaState,
        role: str,
        leg_pace: float | None = None,
        itl_recent_s: float | None = None,
        streams: tuple[StreamProgress, ...] = (),
    ) -> WorkerLoad:
        rep = state.reported
        backlog = self._backlog.get(state.id)
        return WorkerLoad(
            state.id,
            role,
            queued_requests=max(self._prefill_jobs[state.id], rep.waiting if rep else 0),
            queued_prefill_tokens=self._prefill_tokens[state.id],
            waiting_legs=backlog.legs if backlog else 0,
            waiting_prefill_tokens=backlog.tokens if backlog else 0,
            running=max(rep.running if rep else 0, state.in_flight - self._prefill_jobs[state.id]),
            context_tokens=rep.context_tokens if rep else 0,
            kv_free_tokens=rep.kv_free_tokens if rep else 0,
            kv_total_tokens=rep.kv_total_tokens if rep else 0,
            leg_pace=leg_pace,
            itl_recent_s=itl_recent_s,
            streams=streams,
        )

    def snapshot(self, decode: PoolSnapshot) -> PDSnapshot:
        """The policy's view: `decode` (the available decode replicas) and the prefill pool's
        available replicas, whether or not they have a slot free (a queue is for the policy to weigh),
        each with the legs waiting here for its slots.
        A prefill replica's observed pace is its recent legs' time over AMPD's modelled time, a
        decode replica's observed ITL the windowed gap of the streams this gateway relays from it."""
        pool = self.prefill
        prefill = (
            ()
            if pool is None
            else tuple(
                self._load(s, "prefill", leg_pace=self.leg_pace(s.id))
                for s in pool.snapshot(need_slot=False).replicas
            )
        )
        return PDSnapshot(
            prefill=prefill,
            decode=tuple(
                self._load(s, "decode", itl_recent_s=self.itl_recent_s(s.id), streams=self.streams(s.id))
                for s in decode.replicas
            ),
            now=decode.now,
            ttft_slo_s=self.ttft_slo_s,
            itl_slo_s=self.itl_slo_s,
        )

    def cached_tokens(self, pool: ReplicaPool, request: RequestInfo) -> dict[str, int]:
        """Prompt tokens each decode and prefill replica holds, from the pool's prefix index (the
        prefill pool shares it); empty when the pool's policy keeps none."""
        index = getattr(pool.policy, "index", None)
        if index is None or not request.block_hashes:
            return {}
        matched = index.match(request.block_hashes)
        return {r: min(n * request.block_tokens, request.prompt_tokens) for r, n in matched.items()}

    def chooser(self, pool: ReplicaPool, request: RequestInfo, placement: PDPlacement) -> Chooser:
        """The decode pool's `choose`: the PD policy places the request; its decision is kept in
        `placement` (the pool may ask again while the chosen replica has no slot free)."""

        def choose(req: RequestInfo, snap: PoolSnapshot) -> Decision | None:
            if not snap.replicas:
                return None
            if placement.bound is not None:  # another gateway's binding: the policy starts from it
                self.policy.bindings.bind(req.session_id, placement.bound)
            job = PrefillJob(
                f"{req.session_id}:{placement.round}",
                req.prompt_tokens,
                session_id=req.session_id,
                round=placement.round,
                cached_tokens=self.cached_tokens(pool, req),
                max_tokens=req.max_tokens,
                arrived_at=placement.arrived_at,
            )
            placement.job = job
            placement.decision = decision = self.policy.place(job, self.snapshot(snap))
            # the pool counts its picks by reason (the gateway's /metrics): the PD policy's, which
            # says local or remote
            return Decision(decision.decode, f"pd {decision.reason}")

        return choose

    async def start(self, session_id: str | None) -> PDPlacement:
        """A request of `session_id` is being placed: its round and shared binding."""
        arrived_at = time.monotonic()
        turn: SessionTurn = await self.rounds.next(session_id)
        return PDPlacement(turn.round, turn.bound, arrived_at)

    async def share_binding(self, session_id: str | None, placement: PDPlacement) -> None:
        """Store the policy's binding for the other gateways when it differs from the shared one."""
        decision = placement.decision
        if session_id is None or decision is None or decision.decode == placement.bound:
            return
        await self.rounds.bind(session_id, decision.decode)
        placement.bound = decision.decode

    def failed(self, worker: str, placement: PDPlacement) -> None:
        """A decode worker failed before answering: the policy forgets it (its sessions rebind and
        their KV is rebuilt where they go), and so does this request's shared binding."""
        self.policy.forget_worker(worker)
        if placement.bound == worker:
            placement.bound = None

    def holds(self, pool: ReplicaPool, request: RequestInfo, worker: str) -> None:
        """`worker`'s leg answered, so its engine holds the prompt's KV now: an index that learns from
        the dispatch (no KV events) credits it then, not at placement, so a request placed while the
        prompt is still being computed is not costed as if it were cached there."""
        index = getattr(pool.policy, "index", None)
        if index is not None and getattr(pool.policy, "learn", False) and request.block_hashes:
            index.insert(request.block_hashes, worker)
        if pool is self.prefill and worker in self._backlog:
            self._backlog[worker].hold(request.block_hashes)

    def pinned(self, worker: str) -> Chooser:
        """The prefill pool's `choose` for the worker the policy named: wait for its slot, or give up
        at once when its breaker no longer admits traffic (the decode replica then prefills)."""

        def choose(req: RequestInfo, snap: PoolSnapshot) -> Decision | None:
            if worker not in snap.by_id:
                raise PoolUnavailable(f"prefill worker {worker} is not available")
            return Decision(worker, "pd prefill")

        return choose

    @asynccontextmanager
    async def prefill_slot(
        self, worker: str, job: PrefillJob, request: RequestInfo, max_wait: float | None
    ) -> AsyncIterator[Lease]:
        """A slot of prefill worker `worker` for `job`'s leg: its turn at the gate, then the prefill
        pool's lease, counted as waiting for the policies' snapshot until both are held, then as under
        way there (its prompt's blocks are the worker's to compute, not the legs' waiting behind it).
        `PoolOverloaded` when a wait runs out, `PoolUnavailable` when the worker is not available."""
        assert self.prefill is not None
        backlog = self._backlog.get(worker)
        if backlog is None:
            backlog = self._backlog[worker] = PrefillBacklog(request.block_tokens)
        hashes = request.block_hashes
        leg = leg_blocks(hashes, job.prompt_tokens, job.cached_on(worker), request.block_tokens)
        async with AsyncExitStack() as stack:
            backlog.wait(leg)
            try:
                await stack.enter_async_context(self.prefill_turn(worker, job, max_wait))
                lease = await stack.enter_async_context(
                    self.prefill.acquire(request, choose=self.pinned(worker), max_wait=max_wait)
                )
            finally:
                backlog.unwait(leg)
            backlog.start(hashes)
            try:
                yield lease
            finally:
                backlog.finish(hashes)

    @asynccontextmanager
    async def prefill_turn(self, worker: str, job: PrefillJob, max_wait: float | None) -> AsyncIterator[None]:
        """The wait of a prefill leg for `worker` ahead of the prefill pool's own: through the gate
        when there is one (`PoolOverloaded` when its wait runs out), else none."""
        if self.gate is None or self.prefill is None:
            yield
            return
        replica = self.prefill.replicas[worker]
        wait = self.prefill.queue_timeout if max_wait is None else max_wait
        async with self.gate.turn(worker, job, replica.effective_limit, wait):
            yield

    @contextmanager
    def prefilling(self, worker: str, tokens: int) -> Iterator[None]:
        """Count a prefill under way on `worker` for the policies' snapshot."""
        self._prefill_jobs[worker] += 1
        self._prefill_tokens[worker] += tokens
        try:
            yield
        finally:
            self._prefill_jobs[worker] -= 1
            self._prefill_tokens[worker] -= tokens

    def prefill_body(self, content: bytes, history: tuple[str, str, int] | None) -> bytes:
        """The prefill leg: the client's request for one token, not streamed, asking for a handle;
        `history`: the decode engine that holds the session's earlier rounds."""
        body = orjson.loads(content)
        kv: dict[str, Any] = {"do_remote_decode": True}
        if history is not None:
            engine_id, host, port = history
            kv["history"] = {"remote_engine_id": engine_id, "remote_host": host, "remote_port": port}
        body.update(max_tokens=1, stream=False, kv_transfer_params=kv)
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        return orjson.dumps(body)

    async def aclose(self) -> None:
        await self.rounds.aclose()


def decode_body(content: bytes, handle: Mapping[str, Any]) -> bytes:
    """The decode leg: the client's request plus the handle the prefill leg returned."""
    return orjson.dumps({**orjson.loads(content), "kv_transfer_params": dict(handle)})


def prompt_token_sources(answer: Mapping[str, Any]) -> dict[str, int]:
    src = (answer.get("usage") or {}).get("prompt_token_sources") or {}
    return {k: int(src.get(k, 0)) for k in ("local_cache", "transferred", "computed")}


def prefill_gate(spec: Any) -> PrefillGate | None:
    """The prefill legs' queue a model's `pd` config asks for, or None (first come first served)."""
    if not spec.prefill_queue:
        return None
    return PrefillGate(
        PerfModel.load(spec.perf_model),
        spec.ttft_slo_s,
        lookahead=spec.prefill_lookahead,
        max_deferrals=spec.prefill_max_deferrals,
    )


def pd_policy(spec: Any) -> PDPolicy:
    """The policy a model's `pd` config names (`tokenops.config.PDSpec`), with its options."""
    return make_pd_policy(
        spec.policy,
        PerfModel.load(spec.perf_model) if spec.perf_model is not None else None,
        max_local_prefill_length=spec.max_local_prefill_length,
        max_prefill_queue_size=spec.max_prefill_queue_size,
        non_cached_tokens=spec.non_cached_tokens,
        itl_window_tokens=spec.itl_window_tokens,
        remote_ttft_share=spec.remote_ttft_share,
    )
