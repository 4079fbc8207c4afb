"""The gateway's one call into the cluster: open a response from some replica of a model, with
degradation, retries before the first byte, and fallback model groups.

`Cluster.open(DispatchRequest(...))` is an async context manager yielding an `Upstream` whose first
chunk has already arrived: every failure up to that point (connection refused or reset, a 5xx, a body
that breaks before its first byte) is retried with backoff on another replica, then on the fallback
models' pools, so the client never sees it. Once `Upstream` is handed over, nothing is retried: a break
mid-stream raises `UpstreamBroken` and the gateway ends the stream with an error, because a started
stream must never be duplicated or silently re-run. This module does not authenticate, meter or render
SSE (the gateway does), and does not choose replicas (the pool's policy does).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from tokenops.cluster.degrade import DegradeInput, DegradePolicy
from tokenops.cluster.health import CircuitBreaker, HealthChecker
from tokenops.cluster.load_poller import LoadPoller, root_url
from tokenops.cluster.pd_dispatch import (
    PDPlacement,
    PDRoute,
    StreamGaps,
    decode_body,
    prompt_token_sources,
)
from tokenops.cluster.pool import (
    REPLICA_FAULTS,
    Lease,
    PoolOverloaded,
    PoolUnavailable,
    ReplicaPool,
    ReplicaSpec,
)
from tokenops.cluster.snapshot import RequestInfo
from tokenops.protocol import APIError, model_not_found

# the request body: a JSON object whose "model" the cluster sets, or bytes built for a served name
Body = Mapping[str, Any] | Callable[[str], bytes]
# request headers the cluster sets itself, never taken from the caller
_HOP_HEADERS = frozenset({"host", "content-length", "authorization"})


@dataclass(frozen=True, slots=True)
class RetryConfig:
    attempts: int = 3  # tries per model group (the first try included)
    backoff_base: float = 0.05  # seconds; doubles per try, with full jitter
    backoff_max: float = 1.0
    retry_statuses: frozenset[int] = frozenset({500, 502, 503, 504})
    connect_timeout: float = 5.0
    first_byte_timeout: float = 120.0  # a replica silent this long before its first byte counts as failed
    read_timeout: float = 600.0  # between chunks once streaming
    busy_retry_after: int = 1  # Retry-After seconds on a 429 backend_busy


@dataclass
class DispatchCounters:
    """What the dispatch path did, as plain counts that the gateway's /metrics reads at scrape time
    (this package does not depend on a metrics library)."""

    # (model, replica): tries that failed before the first byte; each is retried while tries remain
    retries: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # (model asked for, model that served): requests served by a fallback group
    fallbacks: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # (model asked for, model that served, cause "overload" | "budget"): requests sent to `degrade_to`
    degradations: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    # (model, priority class): requests refused by a `shed_at` rule
    sheds: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)


@dataclass(frozen=True, slots=True)
class DispatchRequest:
    """One call into the cluster: what to place (`info`), where on the replica (`path`), what to send.

    `body` is a JSON object (its `model` is replaced by the replica's served name) or a function from
    the served name to the encoded body. `budget_left` (fraction of the tightest budget still unspent)
    feeds degradation; `max_wait` bounds the wait for a concurrency slot (default: the pool's
    `queue_timeout`) and `max_queued` the line of waiters of the request's priority class."""

    info: RequestInfo
    path: str
    body: Body
    headers: Mapping[str, str] | None = None
    budget_left: float | None = None
    max_wait: float | None = None
    max_queued: int | None = None


class UpstreamBroken(Exception):
    """The replica failed after the first byte was handed to the gateway; nothing was retried."""


@dataclass
class Attempt:
    model: str
    replica: str
    outcome: str  # "ok", "status 503", "ConnectError: ...", ...


# what aiohttp's own `sock_read` timer raised (SocketTimeoutError is aiohttp 3.10+)
_ReadTimeoutError = getattr(aiohttp, "SocketTimeoutError", aiohttp.ServerTimeoutError)


class ReadWatchdog:
    """The read timeout of one streaming response: its read fails once it has waited `timeout` s for
    the replica. One loop timer per stream, not one per chunk: a read only stamps when it starts
    waiting (`since`, None while the reader is not waiting); the timer, when it fires, fails the read
    if it has waited the timeout and otherwise sleeps until it would have. aiohttp's `sock_read`
    cancels and re-arms a timer on every chunk it reads, which costs more than the stamps
    (`benchmarks/upstream_read_cpu.py`).

    Time the gateway itself holds a chunk (a slow client) does not count, as with `sock_read`, which
    aiohttp stops while its buffer is full."""

    __slots__ = ("_handle", "_loop", "_response", "since", "timeout")

    def __init__(self, response: aiohttp.ClientResponse, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._response = response
        self.timeout = timeout
        self.since: float | None = None
        self._handle = self._loop.call_at(self._loop.time() + timeout, self._check)

    def _check(self) -> None:
        response = self._response
        if response.closed:
            return  # released: nothing is read any more
        since, now = self.since, self._loop.time()
        if since is not None and now - since >= self.timeout:
            # the waiting read raises this, as it did from aiohttp's timer; the connection is not reused
            response.content.set_exception(_ReadTimeoutError("Timeout on reading data from socket"))
            response.close()
            return
        self._handle = self._loop.call_at((now if since is None else since) + self.timeout, self._check)

    def stop(self) -> None:
        self._handle.cancel()


@dataclass
class Upstream:
    """An opened response: status and headers as the replica sent them, the body as bytes."""

    status: int
    headers: CIMultiDictProxy[str]
    model: str  # the model whose pool served (differs from the request's after fallback or degradation)
    replica: str
    degraded: str | None  # reason for the `x-tokenops-degraded` header and the ledger row, if any
    attempts: list[Attempt] = field(default_factory=list)
    sent_at: int = 0  # perf_counter_ns when the first try's body was handed to the HTTP client
    pd: PDPlacement | None = None  # a PD model's: its decision and prefill leg
    _first: bytes = b""
    _response: aiohttp.ClientResponse | None = None  # the rest of the body is read from its content
    _read_timeout: float | None = None  # the longest wait for the replica between chunks
    _lease: Lease | None = None
    _gaps: StreamGaps | None = None  # a PD model's: its decode worker's windowed ITL, fed as it streams

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        gaps = self._gaps
        if self._first:
            if gaps is not None:
                gaps.relayed(self._first)
            yield self._first
        response = self._response
        if response is None:
            return
        read = response.content.readany
        watchdog = ReadWatchdog(response, self._read_timeout) if self._read_timeout else None
        try:
            if watchdog is None:
                while chunk := await read():
                    if gaps is not None:
                        gaps.relayed(chunk)
                    yield chunk
            else:
                clock = asyncio.get_running_loop().time
                while True:
                    watchdog.since = clock()
                    chunk = await read()
                    watchdog.since = None
                    if not chunk:
                        break
                    if gaps is not None:
                        gaps.relayed(chunk)
                    yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if self._lease is not None:
                self._lease.fail(f"broken mid-stream: {type(exc).__name__}")
            raise UpstreamBroken(
                f"replica {self.replica} broke mid-stream: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if watchdog is not None:
                watchdog.stop()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.aiter_bytes()])


class Cluster:
    """Pools by model name, their fallbacks and the degradation policy; the dispatch API."""

    def __init__(
        self,
        pools: Mapping[str, ReplicaPool],
        *,
        fallbacks: Mapping[str, list[str]] | None = None,
        degrade: DegradePolicy | None = None,
        retry: RetryConfig | None = None,
        client: aiohttp.ClientSession | None = None,
        health_check_interval: float = 2.0,
        health_check_timeout: float = 5.0,
        load_poll_interval: float = 1.0,
        pd: Mapping[str, PDRoute] | None = None,
    ) -> None:
        self.pools = dict(pools)
        # PD models' routes by model name: their decode pool is the model's pool, plus a prefill pool
        self.pd = dict(pd or {})
        self.fallbacks = {k: list(v) for k, v in (fallbacks or {}).items()}
        for model, chain in self.fallbacks.items():
            for m in (model, *chain):
                if m not in self.pools:
                    raise ValueError(f"fallback chain of {model!r} names {m!r}, which has no pool")
        self.degrade = degrade or DegradePolicy()
        self.retry = retry or RetryConfig()
        self._timeout_for: RetryConfig | None = None
        self._client_timeout: aiohttp.ClientTimeout | None = None
        self.counters = DispatchCounters()
        self._client = client
        self._own_client = client is None
        self.poller = LoadPoller(self._all_pools(), interval=load_poll_interval)
        self.health = HealthChecker(
            self._health_targets, interval=health_check_interval, timeout=health_check_timeout
        )

    def _all_pools(self) -> list[ReplicaPool]:
        """Every pool: the models' and the PD models' prefill pools."""
        return [*self.pools.values(), *(r.prefill for r in self.pd.values() if r.prefill is not None)]

    def _health_targets(self) -> list[tuple[str, CircuitBreaker]]:
        # providers (kind "openai") are judged by real traffic only: no probing of metered APIs
        return [
            (root_url(r.url), r.breaker)
            for pool in self._all_pools()
            for r in pool.replicas.values()
            if r.spec.kind != "openai"
        ]

    async def start(self) -> None:
        """Start the background load poller and active health checker (call inside the event loop),
        and load the prompt tokenizers now, while replicas start, rather than on the first request."""
        self.poller.start()
        self.health.start()
        for pool in self.pools.values():
            if pool.prompt_tokenizer is not None:
                pool.prompt_tokenizer.start_loading()

    @property
    def _timeout(self) -> aiohttp.ClientTimeout:
        # built once per retry config, not once per request
        if self._timeout_for is not self.retry:
            self._timeout_for = self.retry
            # no sock_read: aiohttp re-arms that timer on every chunk; Upstream's ReadWatchdog keeps
            # the read timeout with one timer per stream, and first_byte_timeout covers the wait before
            self._client_timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self.retry.connect_timeout, sock_read=None
            )
        return self._client_timeout

    @property
    def client(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx, on the request path: httpx cost markedly more CPU per relayed request
        if self._client is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
            # no cookie jar: a replica's Set-Cookie must never ride along on another tenant's request
            self._client = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._client

    async def aclose(self) -> None:
        await self.poller.stop()
        await self.health.stop()
        for route in self.pd.values():
            await route.aclose()
        if self._own_client and self._client is not None:
            await self._client.close()
            self._client = None

    def models(self) -> list[str]:
        return sorted(self.pools)

    def replica_restarted(self, url: str) -> None:
        """A supervised process behind `url` restarted: its KV cache and event stream start empty."""
        for pool in self._all_pools():
            for r in pool.replicas.values():
                if root_url(r.url) == root_url(url):
                    pool.forget_cache(r.id)
                    self.poller.replica_restarted(pool.model, r.id)

    def status(self) -> dict[str, Any]:
        """Per model and replica: breaker state, weight factor, concurrency limit, in flight, last report.
        For the admin API and the dashboard."""
        out: dict[str, Any] = {}
        for name, pool in self.pools.items():
            reps = []
            for r in pool.replicas.values():
                rep = r.reported
                reps.append(
                    {
                        "id": r.id,
                        "url": r.url,
                        "kind": r.spec.kind,
                        "breaker": str(r.breaker.state),
                        "weight": r.spec.weight * r.breaker.weight_factor(),
                        "concurrency_limit": r.effective_limit(),
                        "in_flight": r.in_flight,
                        "reported": None
                        if rep is None
                        else {
                            "running": rep.running,
                            "waiting": rep.waiting,
                            "kv_usage": rep.kv_usage,
                            "prefix_cache_queries": rep.prefix_cache_queries,
                            "prefix_cache_hits": rep.prefix_cache_hits,
                        },
                    }
                )
            tok = pool.prompt_tokenizer
            out[name] = {
                "policy": getattr(pool.policy, "name", type(pool.policy).__name__),
                "prompt_tokenizer": None
                if tok is None
                else {
                    "source": tok.source,
                    "state": tok.state,
                    "block_size": tok.block_size,
                    "error": tok.error,
                },
                "utilisation": pool.utilisation(),
                "waiting": pool.waiting,
                "replicas": reps,
            }
        return out

    @asynccontextmanager
    async def open(self, call: DispatchRequest) -> AsyncIterator[Upstream]:
        """POST `call.body` to `replica.url + call.path` on a replica of `call.info.model` and yield
        the response once its first chunk is in.

        Raises `APIError`: 404 unknown model; 429 `backend_busy` when the wait or the line runs out;
        503 `overloaded` when shed, `upstream_unavailable` when every replica is unhealthy (both with
        Retry-After); 502 `upstream_failed` when every try failed. The message says what happened.
        """
        request, budget_left = call.info, call.budget_left
        pool = self.pools.get(request.model)
        if pool is None:
            raise model_not_found(request.model, self.models())
        decision = self.degrade.decide(
            DegradeInput(request.model, pool.utilisation(), request.priority, budget_left)
        )
        if decision.action == "shed":
            self.counters.sheds[(request.model, request.priority)] += 1
            raise APIError(
                503,
                f"The service is overloaded and is shedding low-priority requests ({decision.reason}). "
                "Retry later or use a higher-priority key.",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "2"},
            )
        first = decision.model
        if first not in self.pools:
            first = request.model  # a degrade_to without a pool is a config slip: serve as asked
        chain = [first] + [m for m in self.fallbacks.get(request.model, []) if m != first]
        attempts: list[Attempt] = []
        overloaded: str | None = None
        sent = [0]  # when the first try went out: retries and their backoff are the backend's time
        async with AsyncExitStack() as stack:
            upstream = None
            for model in chain:
                try:
                    on_model = replace(call, info=replace(request, model=model))
                    upstream = await self._open_on(stack, self.pools[model], on_model, attempts, sent)
                except PoolOverloaded as exc:
                    overloaded = str(exc)
                    continue
                if upstream is not None:
                    break
            if upstream is None:
                raise self._exhausted(request, attempts, overloaded)
            reasons = [decision.reason] if decision.action == "degrade" else []
            if decision.action == "degrade" and first != request.model:
                self.counters.degradations[(request.model, upstream.model, decision.cause or "")] += 1
            if upstream.model != first:
                reasons.append(f"fallback: {first} unavailable, served by {upstream.model}")
                self.counters.fallbacks[(request.model, upstream.model)] += 1
            upstream.degraded = "; ".join(r for r in reasons if r) or None
            upstream.attempts = attempts
            upstream.sent_at = sent[0]
            yield upstream

    async def _open_on(
        self,
        stack: AsyncExitStack,
        pool: ReplicaPool,
        call: DispatchRequest,
        attempts: list[Attempt],
        sent: list[int],
    ) -> Upstream | None:
        """Try up to `retry.attempts` replicas of one pool; the first good response is entered into
        `stack` (so its lease and connection live until the caller is done) and returned."""
        request = call.info
        excluded: set[str] = set()
        route = self.pd.get(pool.model)
        placement = await route.start(request.session_id) if route is not None else None
        for n in range(self.retry.attempts):
            if n:
                await asyncio.sleep(
                    random.uniform(0, min(self.retry.backoff_max, self.retry.backoff_base * 2**n))
                )
            inner = AsyncExitStack()
            choose = None
            if route is not None:
                assert placement is not None
                placement.passed_over.extend(placement.legs)
                placement.legs = []
                choose = route.chooser(pool, request, placement)
            try:
                lease = await inner.enter_async_context(
                    pool.acquire(
                        request, excluded, max_wait=call.max_wait, max_queued=call.max_queued, choose=choose
                    )
                )
            except PoolUnavailable:
                await inner.aclose()
                return None
            except BaseException:
                await inner.aclose()
                raise
            replica = lease.replica
            attempt = _Try(inner, lease, pool, call, sent)
            try:
                if route is None:
                    upstream = await self._send(attempt)
                else:
                    assert placement is not None
                    upstream = await self._send_pd(attempt, route, placement)
            except REPLICA_FAULTS as exc:
                outcome = f"{type(exc).__name__}: {exc}".strip(": ")
                lease.fail(outcome)
                await inner.aclose()
                attempts.append(Attempt(pool.model, replica.id, outcome))
                self.counters.retries[(pool.model, replica.id)] += 1
                excluded.add(replica.id)
                if route is not None:
                    assert placement is not None
                    route.failed(replica.id, placement)
                continue
            except BaseException as exc:  # cancelled: release the lease with no verdict
                await inner.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            if upstream.status in self.retry.retry_statuses:
                lease.fail(f"status {upstream.status}")
                await inner.aclose()
                attempts.append(Attempt(pool.model, replica.id, f"status {upstream.status}"))
                self.counters.retries[(pool.model, replica.id)] += 1
                excluded.add(replica.id)
                if route is not None:
                    assert placement is not None
                    route.failed(replica.id, placement)
                continue
            attempts.append(
                Attempt(
                    pool.model, replica.id, "ok" if upstream.status < 400 else f"status {upstream.status}"
                )
            )
            await stack.enter_async_context(inner)
            return upstream
        return None

    async def _send(self, attempt: _Try, content: bytes | None = None) -> Upstream:
        """POST the try's call (or `content`, a body already built for its replica) and wait for its
        first chunk."""
        lease, call = attempt.lease, attempt.call
        spec = lease.replica.spec
        if content is None:
            content = _content(call, spec.served_model or attempt.pool.model)
        if not attempt.sent[0]:
            attempt.sent[0] = time.perf_counter_ns()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps each await in a new task
        async with asyncio.timeout(self.retry.first_byte_timeout):
            resp = await self.client.post(
                spec.url.rstrip("/") + call.path,
                data=content,
                headers=_headers(spec, call.headers),
                timeout=self._timeout,
            )
        attempt.stack.callback(resp.release)
        first = b""
        if resp.status not in self.retry.retry_statuses:
            async with asyncio.timeout(self.retry.first_byte_timeout):
                first = await resp.content.readany()  # b"" for an empty body
        lease.first_byte()
        return Upstream(
            status=resp.status,
            headers=resp.headers,
            model=attempt.pool.model,
            replica=lease.replica.id,
            degraded=None,
            _first=first,
            _response=resp,
            _read_timeout=self.retry.read_timeout,
            _lease=lease,
        )

    async def _send_pd(self, attempt: _Try, route: PDRoute, placement: PDPlacement) -> Upstream:
        """A PD model's try on the decode replica the policy chose: the prefill leg first when the
        policy placed the prefill remotely, then the decode leg with its handle; without a handle
        (local placement, or a prefill leg that failed) the decode replica prefills itself."""
        decision, job = placement.decision, placement.job
        assert decision is not None and job is not None
        pool, call = attempt.pool, attempt.call
        await route.share_binding(call.info.session_id, placement)
        replica = attempt.lease.replica
        # the answer counts as under way on its decode worker from now until the call is done, or
        # until this try fails
        gaps = route.stream_gaps(replica.id, job.max_tokens)
        attempt.stack.callback(gaps.close)
        content = _content(call, replica.spec.served_model or pool.model)
        if not attempt.sent[0]:
            attempt.sent[0] = time.perf_counter_ns()
        handle = None
        try:
            if decision.prefill is not None:
                pull = placement.round and decision.pull_history and replica.reported
                history = replica.reported.kv_transfer if pull else None
                handle = await self._prefill_leg(
                    route, call, route.prefill_body(content, history), placement, history is not None
                )
            if handle is not None:
                body = decode_body(content, handle) if handle else content
                upstream = await self._send(attempt, body)
            else:
                with route.prefilling(replica.id, job.uncached_on(replica.id)):
                    upstream = await self._send(attempt, content)
        except BaseException:
            gaps.close()
            raise
        if upstream.status < 400:  # our engine (and vLLM) answer once the prompt is computed
            route.holds(pool, call.info, replica.id)
        else:
            gaps.close()
        upstream.pd = placement
        upstream._gaps = gaps
        return upstream

    async def _prefill_leg(
        self, route: PDRoute, call: DispatchRequest, body: bytes, placement: PDPlacement, pulls: bool
    ) -> dict[str, Any] | None:
        """The prefill leg on a slot of the worker the policy named; its handle, or None when it found
        no slot or failed (a failure counts against the worker's breaker). `pulls`: it works on the
        session's history pulled from the decode worker."""
        assert route.prefill is not None and placement.decision is not None and placement.job is not None
        worker, job = placement.decision.prefill, placement.job
        assert worker is not None
        computes = job.uncached_on(worker, placement.decision.decode if pulls else None)
        leg: dict[str, Any] = {"worker": worker, "kind": "prefill", "status": "unavailable"}
        placement.legs.append(leg)
        queued_at = time.monotonic()
        try:
            async with route.prefill_slot(worker, job, call.info, call.max_wait) as lease:
                sent = time.monotonic()
                leg["queued_s"] = sent - queued_at  # its wait for the worker's slot
                leg["sent_s"] = sent - placement.arrived_at  # when it went, from the request's placing
                spec = lease.replica.spec
                with route.prefilling(worker, computes):
                    async with asyncio.timeout(self.retry.first_byte_timeout):
                        async with self.client.post(
                            spec.url.rstrip("/") + call.path,
                            data=body,
                            headers=_headers(spec, call.headers),
                            timeout=self._timeout,
                        ) as resp:
                            leg["status"] = resp.status
                            raw = await resp.read()
                lease.first_byte()
                try:
                    answer = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    answer = None
                if resp.status != 200 or not isinstance(answer, dict):
                    if resp.status >= 500 or resp.status == 200:
                        lease.fail(f"prefill leg: status {resp.status}")
                    return None
                answered = time.monotonic()
                leg["answered_s"] = answered - placement.arrived_at  # its answer, from the placing
                leg.update(prompt_token_sources(answer), kv_transfer=answer.get("kv_transfer"))
                route.holds(route.prefill, call.info, worker)
                estimate = placement.decision.estimate
                if estimate is not None:
                    route.leg_answered(worker, answered - queued_at, estimate.remote_leg_s)
                handle = answer.get("kv_transfer_params")
                # a connector that finds the KV by the prompt's content (vLLM's ExampleConnector)
                # answers without a handle: the decode leg is then the client's request as it came
                return handle if isinstance(handle, dict) else {}
        except (PoolUnavailable, PoolOverloaded):
            return None
        except REPLICA_FAULTS as exc:
            leg["status"] = f"failed: {type(exc).__name__}"
            return None

    def _exhausted(self, request: RequestInfo, attempts: list[Attempt], overloaded: str | None) -> APIError:
        model = request.model
        if overloaded is not None and not attempts:
            retry = self.retry.busy_retry_after
            return APIError(
                429,
                f"The backends of model '{model}' are at capacity and priority class {request.priority} "
                f"was refused: {overloaded}. Retry after {retry} s, "
                "or use a key with a higher priority class.",
                type="rate_limit_error",
                code="backend_busy",
                headers={"Retry-After": str(retry)},
            )
        if not attempts:
            return APIError(
                503,
                f"No replica of '{model}' (or its fallbacks) is available: "
                "all are marked unhealthy. Retry later.",
                type="server_error",
                code="upstream_unavailable",
                headers={"Retry-After": "5"},
            )
        tried = "; ".join(f"{a.model}@{a.replica}: {a.outcome}" for a in attempts)
        return APIError(
            502,
            f"Every replica tried for '{model}' failed before responding ({tried}).",
            type="server_error",
            code="upstream_failed",
        )


@dataclass(slots=True)
class _Try:
    """One try of a call on one leased replica: what its sends share. `stack` holds the response
    until the caller is done; `sent` is the call's first send time, shared by all its tries."""

    stack: AsyncExitStack
    lease: Lease
    pool: ReplicaPool
    call: DispatchRequest
    sent: list[int]


def _content(call: DispatchRequest, served: str) -> bytes:
    body = call.body
    return body(served) if callable(body) else orjson.dumps({**body, "model": served})


def _headers(spec: ReplicaSpec, headers: Mapping[str, str] | None) -> dict[str, str]:
    hdrs = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS} if headers else {}
    hdrs["content-type"] = "application/json"
    hdrs["accept-encoding"] = "identity"  # bytes are relayed as they come: no compressed bodies
    if spec.api_key:
        hdrs["authorization"] = f"Bearer {spec.api_key}"
    return hdrs
