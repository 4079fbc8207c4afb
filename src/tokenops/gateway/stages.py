"""The stages of the request path, each one function with one typed object in and one out.

authenticate (`Arrival` -> `Authenticated`) -> admit (-> `Admitted`) -> lookup (-> `CacheLookup`)
-> plan (-> `Planned`) -> dispatch (`Dispatch` -> the answer to store) -> settle (`Exchange` -> the
ledger row) -> store (`Store`). This module owns what each stage decides: which price a request is
admitted at (a cascade's or ensemble's worst case, from tokenops.fusion), the cache scope, the plan
and the output cap the budget allows, running the plan (the fusion executor over the cluster port;
a single model is relayed as it comes), and the metrics of a settled request. The order, and the
guarantee that an admitted request settles exactly once whatever happens, are routes.py's; the calls
to the cluster are upstream.py's, the writes to the client reply.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenops.cache import CachedResponse, CacheScope
from tokenops.cache.scope import CacheDirective, CacheQuery
from tokenops.fusion.executor import Relay, RunRecord, Step, execute
from tokenops.fusion.plan import Plan
from tokenops.gateway.admission_gate import Slot
from tokenops.gateway.client_watch import ClientWatch
from tokenops.gateway.exchange import Exchange, usage_from_openai
from tokenops.gateway.reply import Reply
from tokenops.gateway.request import InboundRequest
from tokenops.gateway.sse import StreamCut, budget_exhausted
from tokenops.gateway.upstream import Calls, ClusterPort
from tokenops.ops.distill import record_example
from tokenops.ops.domain import (
    Admission,
    AdmissionRequest,
    LedgerRow,
    ModelCall,
    Outcome,
    Principal,
    TokenUsage,
)
from tokenops.ops.pricing import Price
from tokenops.protocol import APIError, model_not_found

if TYPE_CHECKING:
    from tokenops.fusion.executor import Answer
    from tokenops.fusion.plan import RouteConfig
    from tokenops.fusion.strategies import WorstCasePrice
    from tokenops.gateway.app import Gateway

log = logging.getLogger("tokenops.gateway")


class RequestOps(Protocol):
    """What the request path needs of the ops layer (`tokenops.ops.service.Operations` is one)."""

    async def authenticate(self, api_key: str | None) -> Principal: ...

    async def admit(self, principal: Principal, req: AdmissionRequest) -> Admission: ...

    async def settle(self, admission: Admission, outcome: Outcome) -> LedgerRow | None: ...

    def price_of(self, model: str) -> Price: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    """A validated request and what its headers say."""

    inbound: InboundRequest
    api_key: str | None
    cache_directive: CacheDirective | None  # None: the gateway has no cache
    task: str | None  # x-tokenops-task: a declared task for a route's router


@dataclass(frozen=True, slots=True)
class Authenticated:
    arrival: Arrival
    principal: Principal


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted request: from here on it settles exactly once."""

    arrival: Arrival
    admission: Admission
    route: RouteConfig | None  # the virtual model the client named, if any
    slot: Slot | None = None  # its place on the fair admission gate's line, released after settle

    @property
    def inbound(self) -> InboundRequest:
        return self.arrival.inbound


@dataclass(frozen=True, slots=True)
class CacheLookup:
    query: CacheQuery | None  # set while the answer may still be stored
    hit: CachedResponse | None


@dataclass(frozen=True, slots=True)
class Planned:
    """The plan and the output the budget allows per choice (None: the client's own, uncapped)."""

    plan: Plan
    max_tokens: int | None
    budget_cut: bool  # max_tokens was lowered by the budget, not by the client


@dataclass(frozen=True, slots=True)
class Dispatch:
    admitted: Admitted
    planned: Planned
    reply: Reply
    collect: bool  # keep the whole answer for the cache


@dataclass(frozen=True, slots=True)
class Store:
    query: CacheQuery | None
    answer: dict[str, Any] | bytes | None
    exchange: Exchange


async def authenticate(ops: RequestOps, arrival: Arrival) -> Authenticated:
    return Authenticated(arrival, await ops.authenticate(arrival.api_key))


async def admit(gw: Gateway, request: Authenticated) -> Admitted:
    """Reserve the request's worst case: a real model at its price; a route at its strong model's
    (the dearer of the two), or, for a cascade or ensemble, every step, each at its model's price."""
    inbound = request.arrival.inbound
    settings = gw.settings
    route: RouteConfig | None = None
    reserve_as = inbound.model
    model = settings.models.get(reserve_as)
    if model is None and gw.fusion is not None and gw.fusion.is_virtual(reserve_as):
        route = gw.fusion.routes[reserve_as]
        reserve_as = gw.fusion.reservation_model(reserve_as)
        model = settings.models[reserve_as]
    if model is None:
        raise model_not_found(inbound.model, [*settings.models, *settings.routes])
    inbound.check_context(model.context_window)
    worst = route.worst_case(gw.ops.price_of) if route is not None else None
    prompt_upper = inbound.prompt_tokens_upper(model.template_overhead_tokens)
    principal = request.principal
    # the fair gate's wait comes before the reservation: a waiting request holds no budget
    slot = await gw.gate.enter(
        inbound.model,
        principal.tenant,
        principal.priority,
        cost=max(1, prompt_upper) if gw.settings.fair_queue.cost == "tokens" else 1.0,
    )
    try:
        admission = await _reserve(gw, request, reserve_as, prompt_upper, model.context_window, worst)
    except BaseException:
        slot.release()
        raise
    inbound.cap_reasoning(admission.max_reasoning_tokens, model.reasoning_budget_field)
    return Admitted(request.arrival, admission, route, slot)


async def _reserve(
    gw: Gateway,
    request: Authenticated,
    reserve_as: str,
    prompt_upper: int,
    context_window: int,
    worst: WorstCasePrice | None,
) -> Admission:
    inbound = request.arrival.inbound
    return await gw.ops.admit(
        request.principal,
        AdmissionRequest(
            model=reserve_as,
            prompt_tokens_upper=prompt_upper + (worst.extra_prompt_tokens if worst else 0),
            max_tokens=inbound.max_tokens * inbound.choices if inbound.max_tokens else None,
            context_window=context_window,
            session_id=inbound.session_id,
            fingerprint=inbound.fingerprint,
            price=worst.price if worst else None,
        ),
    )


async def lookup(gw: Gateway, request: Admitted) -> CacheLookup:
    """Exact then semantic, inside the tenant's and the named model's (or route's) scope."""
    cache = gw.cache
    if cache is None:
        return CacheLookup(None, None)
    inbound = request.inbound
    query = cache.query(
        CacheScope(request.admission.principal.tenant, inbound.model),
        inbound,
        request.arrival.cache_directive,
    )
    hit = await cache.lookup_query(query)
    if hit is not None:
        return CacheLookup(None, hit)
    return CacheLookup(query if query.store_ok else None, None)


async def plan(gw: Gateway, request: Admitted) -> Planned:
    """fusion.plan for a route (a real model is a one-model plan), then the output cap: the budget's
    share per choice, or the client's max_tokens if lower. Rules score in microseconds on the loop;
    the kNN and learned routers embed the prompt (a few ms), so they run in a worker thread."""
    inbound, admission, route = request.inbound, request.admission, request.route
    if route is None:
        chosen = Plan((inbound.model,), "direct")
    elif route.router.name == "rules":
        chosen = gw.fusion.plan(inbound, admission, task=request.arrival.task)
    else:
        chosen = await asyncio.to_thread(gw.fusion.plan, inbound, admission, task=request.arrival.task)
    per_choice = admission.max_output_tokens // max(inbound.choices, 1)
    if per_choice < 1:
        raise budget_exhausted(0)
    requested = inbound.max_tokens
    if requested is None:
        max_tokens = per_choice if admission.budget_limited else None
    else:
        max_tokens = min(requested, per_choice)
    budget_cut = (
        admission.budget_limited and max_tokens is not None and (requested is None or max_tokens < requested)
    )
    return Planned(chosen, max_tokens, budget_cut)


def _side_call(ans: Answer, fallback_prompt: int) -> ModelCall | None:
    """An answer that was not returned, billed at its own model's price; None when it cost nothing."""
    if ans.usage:
        usage = usage_from_openai(ans.usage)
    elif ans.obj is None:
        return None  # nothing came back: nothing to bill
    else:
        # the backend reported no usage: bill an estimate of the prompt and a word per token
        usage = TokenUsage(uncached_input=fallback_prompt, output=len(ans.text.split()))
    return ModelCall(ans.model, usage) if usage.prompt_tokens or usage.completion_tokens else None


def _wants_logprobs(inbound: InboundRequest) -> bool:
    lp = inbound.body.get("logprobs")
    return bool(lp) if inbound.kind == "chat" else lp is not None


async def dispatch(gw: Gateway, request: Dispatch) -> dict[str, Any] | bytes | None:
    """Run the plan and answer the client; returns the whole answer for the cache (None: nothing to
    store). A single model's response is relayed as it comes; a cascade's or ensemble's steps run in
    the fusion executor, and what they did goes into the exchange (route trace, side calls) even when
    the run fails or is cancelled. Raises `APIError` before the response has started."""
    admitted, planned, reply = request.admitted, request.planned, request.reply
    inbound, admission = admitted.inbound, admitted.admission
    exchange = reply.exchange
    chosen = planned.plan
    if chosen.body_fields:  # the plan's reasoning level goes to every upstream call
        inbound = dataclasses.replace(inbound, body={**inbound.body, **chosen.body_fields})
    exchange.model = chosen.model
    calls = Calls(
        gw.cluster,
        inbound,
        reply.request_id,
        admission.priority,
        gw.settings.queue.classes[min(max(admission.priority, 0), len(gw.settings.queue.classes) - 1)],
        admission.budget_left,
        planned.max_tokens,
        gw.prefix_models,
    )
    if chosen.strategy == "single":
        route = chosen.header() if admitted.route is not None else None
        exchange.route = route
        body = calls.client_body(stream=gw.settings.models[chosen.model].stream_upstream)

        def marked_sent(served: str) -> bytes:
            # the backend gets the prompt: a client that leaves from here on is billed its prefill
            exchange.sent_upstream = True
            return body(served)

        stored: dict[str, Any] | bytes | None = None
        # watched from the wait for a slot to the last byte: a client gone at any point cancels
        # the upstream call at once (the replica stops and frees its slot)
        watch = ClientWatch(reply.receive)
        # a whole answer cut off mid-stream has sent the client nothing yet: it is asked again
        attempts = 1 if inbound.stream else max(gw.cluster.retry.attempts, 1)
        async with watch:
            for attempt in range(attempts):
                try:
                    async with calls.open(calls.request(chosen.model, marked_sent)) as up:
                        if up.pd is not None:  # a PD model's: what its prefill leg computed
                            exchange.prefill_computed = up.pd.prefill_computed
                        stored = await reply.relay(
                            up,
                            route,
                            watch,
                            collect=request.collect,
                            timed=True,
                            probing=gw.probing,
                            complete=True,
                        )
                    break
                except StreamCut:
                    if reply.started or attempt == attempts - 1:
                        raise
                    gw.metrics.whole_answer_retried(chosen.model)
        if watch.gone:
            exchange.fail("client_disconnected", 499, "client_disconnected")
        return stored
    record = RunRecord(chosen)
    try:
        policy = admitted.route.policy if admitted.route is not None else None
        result = await execute(chosen, policy, ClusterPort(calls), record)
        if isinstance(result, Relay):
            return await _relay_last(calls, reply, record, result.model, request.collect)
        exchange.model = result.model  # metrics at settle count the answering model
        return await reply.whole(result, record.route(), keep_logprobs=_wants_logprobs(inbound))
    finally:
        exchange.route = record.route()
        fallback = inbound.prompt_tokens_estimate()
        exchange.side_calls.extend(c for a in record.side if (c := _side_call(a, fallback)) is not None)
        for model, outcome in record.outcomes:
            gw.metrics.fusion_step(chosen.route or "", model, outcome)
        if record.verdicts:  # a cascade's labels, kept if the route learns and the tenant opted in
            tenant = getattr(admission.principal, "tenant", None)
            gw.fusion.learn(chosen, record.verdicts, tenant, ClusterPort(calls).question)
        if record.distill is not None and admission.principal.tenant in gw.settings.distill.tenants:
            await _keep_for_distillation(gw, admitted, *record.distill)


async def _keep_for_distillation(gw: Gateway, admitted: Admitted, ans: Answer, reason: str) -> None:
    """The prompt and the answer, as a fine-tuning example of the tenant's (it opted in)."""
    inbound = admitted.inbound
    if inbound.kind == "chat":
        messages = list(inbound.body.get("messages") or [])
    else:
        messages = [{"role": "user", "content": inbound.body.get("prompt")}]
    messages.append({"role": "assistant", "content": ans.text})
    tenant, route = admitted.admission.principal.tenant, inbound.model
    try:
        await gw.ops.db.run(record_example, tenant, ans.model, route, reason, messages)
    except Exception:
        log.exception("recording a distillation example for %s failed", tenant)


async def _relay_last(
    calls: Calls, reply: Reply, record: RunRecord, model: str, collect: bool
) -> dict[str, Any] | bytes | None:
    """A cascade's last model relayed live to a streaming client."""
    exchange = reply.exchange
    stored: dict[str, Any] | bytes | None = None
    watch = ClientWatch(reply.receive)
    try:
        async with watch, calls.open(calls.request(model, calls.client_body(Step(stream=True)))) as up:
            record.step(up.model, "answered", "streamed")
            stored = await reply.relay(up, record.route(), watch, collect=collect, timed=False, probing=False)
            # billed under the configured name (not the backend's served name); metrics count it too
            exchange.model_served = exchange.model = up.model
    except APIError as err:
        if not reply.started:
            record.failed(model, err)
        raise
    if watch.gone:
        exchange.fail("client_disconnected", 499, "client_disconnected")
    return stored


async def settle(gw: Gateway, exchange: Exchange) -> LedgerRow | None:
    """Commit the actual cost and write the ledger row, then count the request in the metrics."""
    row = await exchange.settle(gw.ops)
    settle_ns = exchange.settle_ns
    model = exchange.model or exchange.inbound.model
    outcome = exchange.settled_outcome
    if outcome is not None:
        gw.metrics.settled(model, exchange.admission.principal.tenant, outcome, row.cost_micros if row else 0)
    gw.metrics.timed(model, exchange.timer, settle_ns)
    return row


async def store(gw: Gateway, request: Store) -> None:
    """Store a finished answer; after the client has it and the ledger its row, so it delays neither."""
    if request.query is not None and request.answer is not None and request.exchange.status == "ok":
        assert gw.cache is not None
        await gw.cache.store_query(request.query, request.answer)
