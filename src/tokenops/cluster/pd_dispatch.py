"""Running one request through a prefill pool and a decode pool: the PD policy's decision turned into
the two legs of vLLM's disaggregated-prefill contract, with the fallbacks that keep a request whole.

`PDDispatch.complete(body, ...)` polls the workers' `/v1/load` into a `PDSnapshot`, asks the policy
where the prefill runs, sends the prefill leg (`kv_transfer_params: {do_remote_decode: true}`,
`max_tokens: 1`, plus the bound decode engine as `history` from a session's second round on, so the
prefill engine pulls the history it lacks instead of recomputing it) and then the decode leg with the
handle the prefill leg returned. A prefill worker that fails makes the decode worker prefill locally; a
decode worker that fails before answering (no connection, or a 5xx) is dropped from the policy's
bindings and the request is placed again (its session rebinds and its KV is rebuilt there). Only
the decode leg's answer reaches the caller and only its usage is billable: the prefill leg is internal
work, reported apart in `PDResult.legs`. `open` yields the decode leg's response unread, streamed or
not as the body asks (the gateway relays it like any replica's); `complete` reads it whole.
This module does not choose (the policy does) and does not move KV (the engines do).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenops.cluster.pd import (
    AMPD,
    Colocated,
    ConditionalPD,
    PDDecision,
    PDPolicy,
    PDSnapshot,
    PrefillJob,
    StaticPD,
    WorkerLoad,
)
from tokenops.cluster.perf_model import PerfModel

# a decode leg answered with one of these is placed again on another decode worker
RETRY_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class PDWorker:
    id: str
    url: str  # the engine's base URL, e.g. http://127.0.0.1:8001
    role: str  # "prefill" | "decode" | "both"


@dataclass(slots=True)
class PDResult:
    body: dict[str, Any]  # the decode leg's response: what the caller gets, with the billable usage
    decision: PDDecision
    legs: list[dict[str, Any]] = field(default_factory=list)  # each leg sent: worker, kind, status, kv
    # the legs of earlier placements whose decode worker failed before answering: reported, not billed
    passed_over: list[dict[str, Any]] = field(default_factory=list)

    @property
    def incremental_prefill_tokens(self) -> int:
        """Prompt tokens computed for this request on any engine (not served from a cache or a peer)."""
        return sum(leg.get("computed", 0) for leg in self.legs)


@dataclass(slots=True)
class DecodeLeg:
    """The decode leg's open response; its body is the caller's to read."""

    result: PDResult
    worker: PDWorker
    response: aiohttp.ClientResponse

    @property
    def prefill_computed(self) -> int:
        """Prompt tokens the prefill leg computed (0 when the decode worker prefilled itself)."""
        return sum(leg.get("computed", 0) for leg in self.result.legs if leg["kind"] == "prefill")


class PDDispatchError(RuntimeError):
    """No decode worker answered."""


class PDDispatch:
    def __init__(
        self,
        policy: PDPolicy,
        workers: Sequence[PDWorker],
        http: aiohttp.ClientSession,
        *,
        ttft_slo_s: float = float("inf"),
        itl_slo_s: float = float("inf"),
        timeout_s: float = 120.0,
    ) -> None:
        self.policy = policy
        self.workers = {w.id: w for w in workers}
        self.http = http
        self.ttft_slo_s, self.itl_slo_s = ttft_slo_s, itl_slo_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # a streamed decode leg runs as long as its answer: the limit is on each wait for a chunk
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._kv: dict[str, dict[str, Any]] = {}  # worker id -> its KV transfer endpoint (from /v1/load)
        self._rounds: OrderedDict[str, int] = OrderedDict()  # session -> requests seen, oldest first

    def next_round(self, session_id: str | None, limit: int = 100_000) -> int:
        """The round of a session's next request (0 for its first, and for no session); the oldest
        sessions are forgotten past `limit`, and come back as new ones."""
        if session_id is None:
            return 0
        n = self._rounds.pop(session_id, -1) + 1
        self._rounds[session_id] = n
        if len(self._rounds) > limit:
            self._rounds.popitem(last=False)
        return n

    async def _load(self, w: PDWorker) -> WorkerLoad:
        try:
            async with self.http.get(f"{w.url}/v1/load", timeout=aiohttp.ClientTimeout(total=5)) as r:
                load = await r.json()
        except (aiohttp.ClientError, TimeoutError):
            return WorkerLoad(w.id, w.role, healthy=False)
        if load.get("kv_transfer"):
            self._kv[w.id] = load["kv_transfer"]
        block = int(load.get("block_size", 1))
        total, used = int(load.get("kv_blocks_total", 0)), int(load.get("kv_blocks_used", 0))
        return WorkerLoad(
            w.id,
            w.role,
            queued_requests=int(load.get("waiting", 0)),
            running=int(load.get("running", 0)),
            context_tokens=int(load.get("tokens_in_flight", 0)),
            kv_free_tokens=(total - used) * block,
            kv_total_tokens=total * block,
        )

    async def snapshot(self) -> PDSnapshot:
        loads = await asyncio.gather(*(self._load(w) for w in self.workers.values()))
        return PDSnapshot(
            prefill=tuple(x for x in loads if x.role == "prefill"),
            decode=tuple(x for x in loads if x.role != "prefill"),
            ttft_slo_s=self.ttft_slo_s,
            itl_slo_s=self.itl_slo_s,
        )

    async def _post(self, w: PDWorker, path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.http.post(f"{w.url}{path}", json=dict(body), timeout=self.timeout) as r:
            return r.status, await r.json(content_type=None)

    async def complete(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        prompt_tokens: int,
        session_id: str | None = None,
        round: int = 0,
        cached_tokens: Mapping[str, int] | None = None,
    ) -> PDResult:
        """One request through the PD pools, its decode leg's answer read whole."""
        async with self.open(
            path,
            body,
            prompt_tokens=prompt_tokens,
            session_id=session_id,
            round=round,
            cached_tokens=cached_tokens,
        ) as leg:
            answer = await leg.response.json(content_type=None)
        leg.result.body = answer
        leg.result.legs[-1].update(_sources(answer), kv_transfer=answer.get("kv_transfer"))
        return leg.result

    @asynccontextmanager
    async def open(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        prompt_tokens: int,
        session_id: str | None = None,
        round: int = 0,
        cached_tokens: Mapping[str, int] | None = None,
    ) -> AsyncIterator[DecodeLeg]:
        """One request through the PD pools, yielding the decode leg once its response headers are
        in (streamed when `body` asks for it: the caller reads `response` as it comes). `prompt_tokens`
        is the gateway's count of the prompt, `cached_tokens` what each worker is believed to hold of
        it (its prefix index). Raises `PDDispatchError` when no decode worker answered."""
        job = PrefillJob(
            f"{session_id}:{round}",
            prompt_tokens,
            session_id=session_id,
            round=round,
            cached_tokens=dict(cached_tokens or {}),
            max_tokens=int(body.get("max_tokens") or 0),
        )
        tried: set[str] = set()
        passed_over: list[dict[str, Any]] = []  # the legs of placements whose decode worker failed
        while True:
            snap = await self.snapshot()
            snap = PDSnapshot(
                snap.prefill,
                tuple(w for w in snap.decode if w.id not in tried),
                snap.now,
                snap.ttft_slo_s,
                snap.itl_slo_s,
            )
            if not snap.healthy_decode():
                raise PDDispatchError("no decode worker answered")
            decision = self.policy.place(job, snap)
            result = PDResult({}, decision, passed_over=passed_over)
            handle = await self._prefill_leg(path, body, decision, result, round > 0)
            decode = self.workers[decision.decode]
            leg_body = dict(body)
            if handle is not None:
                leg_body["kv_transfer_params"] = handle
            try:
                timeout = self.stream_timeout if body.get("stream") else self.timeout
                response = await self.http.post(f"{decode.url}{path}", json=leg_body, timeout=timeout)
            except (aiohttp.ClientError, TimeoutError):
                # nothing reached the caller yet: forget the worker, place the request again
                self.policy.forget_worker(decode.id)
                tried.add(decode.id)
                result.legs.append({"worker": decode.id, "kind": "decode", "status": "failed"})
                passed_over.extend(result.legs)
                continue
            result.legs.append({"worker": decode.id, "kind": "decode", "status": response.status})
            if response.status in RETRY_STATUSES:
                # the engine is down behind a live HTTP server (or overloaded): nothing reached the
                # caller, so the request is placed again without this worker
                response.release()
                self.policy.forget_worker(decode.id)
                tried.add(decode.id)
                passed_over.extend(result.legs)
                continue
            try:
                yield DecodeLeg(result, decode, response)
            finally:
                response.release()
            return

    async def _prefill_leg(
        self, path: str, body: Mapping[str, Any], decision: PDDecision, result: PDResult, with_history: bool
    ) -> dict[str, Any] | None:
        if decision.prefill is None:
            return None
        prefill = self.workers[decision.prefill]
        kv: dict[str, Any] = {"do_remote_decode": True}
        source = self._kv.get(decision.decode)
        if with_history and source:
            kv["history"] = {
                "remote_engine_id": source["engine_id"],
                "remote_host": source["host"],
                "remote_port": source["port"],
            }
        leg_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
        leg_body.pop("stream_options", None)
        leg_body.pop("max_completion_tokens", None)
        try:
            status, answer = await self._post(prefill, path, leg_body)
        except (aiohttp.ClientError, TimeoutError):
            status, answer = 0, {}
        ok = status == 200 and isinstance(answer.get("kv_transfer_params"), dict)
        result.legs.append(
            {
                "worker": prefill.id,
                "kind": "prefill",
                "status": status or "failed",
                **(_sources(answer) if ok else {}),
                "kv_transfer": answer.get("kv_transfer"),
            }
        )
        # a failed prefill leg is not the caller's problem: the decode worker prefills itself
        return answer["kv_transfer_params"] if ok else None


def _sources(answer: Mapping[str, Any]) -> dict[str, int]:
    src = (answer.get("usage") or {}).get("prompt_token_sources") or {}
    return {k: int(src.get(k, 0)) for k in ("local_cache", "transferred", "computed")}


def pd_policy(spec: Any) -> PDPolicy:
    """The policy a model's `pd` config names (`tokenops.config.PDSpec`)."""
    if spec.policy == "static":
        return StaticPD()
    if spec.policy == "colocated":
        return Colocated()
    if spec.policy == "dynamo":
        return ConditionalPD.dynamo(spec.max_local_prefill_length, spec.max_prefill_queue_size)
    if spec.policy == "llm_d":
        return ConditionalPD.llm_d(spec.non_cached_tokens)
    if spec.policy == "ampd":
        return AMPD(PerfModel.load(spec.perf_model))
    raise ValueError(f"unknown PD policy {spec.policy!r}")


def _root(url: str) -> str:
    # the config names OpenAI base URLs (…/v1); the legs post to the engine's root + /v1/...
    return url[: -len("/v1")] if url.endswith("/v1") else url


def pd_dispatch(spec: Any, http: aiohttp.ClientSession) -> PDDispatch:
    """The dispatch of one model's `pd` config: its pools as workers, its policy and SLOs."""
    workers = [PDWorker(f"prefill-{i}", _root(u), "prefill") for i, u in enumerate(spec.prefill)]
    workers += [PDWorker(f"decode-{i}", _root(u), "decode") for i, u in enumerate(spec.decode)]
    return PDDispatch(
        pd_policy(spec),
        workers,
        http,
        ttft_slo_s=spec.ttft_slo_s,
        itl_slo_s=spec.itl_slo_s,
        timeout_s=spec.timeout_s,
    )
