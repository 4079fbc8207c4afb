"""The public OpenAI endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

This module owns the order of the request path, one stage per call with one typed object between
them: read and validate the body (request.py) -> authenticate (ops) -> admit (ops) -> look up the
response cache (a hit is answered here and settled with no engine tokens) -> open a response on a
replica (`Cluster.open`: balancing, priority-ordered waiting, retries before the first byte,
breakers, fallback, degradation) -> relay the stream (sse.py) or the whole response -> settle exactly
once (exchange.py) -> store a finished answer in the cache. A route whose plan is a cascade or an
ensemble is answered by fusion_exec.py between planning and settling. Every refusal is an OpenAI
error; once a request is admitted, whatever happens, its settle runs in a `finally`, and then the
gateway's own time on it (timing.py) goes to the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tokenops.cache import MISS_HEADERS, CachedResponse, CacheScope, assemble_stream, directive_from_headers
from tokenops.cache.scope import CacheQuery
from tokenops.cluster import DEGRADE_HEADER, RequestInfo, UpstreamBroken
from tokenops.cluster.policies import PREFIX_POLICIES
from tokenops.gateway import fusion_exec, probes
from tokenops.gateway.client_watch import ClientWatch
from tokenops.gateway.exchange import Exchange
from tokenops.gateway.http import (
    SSE_CT,
    ClientGone,
    Receive,
    Scope,
    Send,
    base_headers,
    bearer_token,
    header,
    next_request_id,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from tokenops.gateway.request import PREFIX_BLOCK_TOKENS, InboundRequest, Kind, parse_request
from tokenops.gateway.sse import budget_exhausted, encode_chunks, relay
from tokenops.gateway.timing import PathTimer, now_ns
from tokenops.ops.domain import Admission, AdmissionRequest
from tokenops.protocol import APIError, model_not_found

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway

log = logging.getLogger("tokenops.gateway")

UPSTREAM_PATH: dict[Kind, str] = {"chat": "/chat/completions", "completion": "/completions"}
DEGRADED = DEGRADE_HEADER.lower().encode("latin-1")


def internal_error() -> APIError:
    return APIError(500, "The gateway failed to process the request. Retry; the operator has the log.", type="api_error", code="internal_error")


def _upstream_error(status: int, body: bytes, model: str) -> APIError:
    """A backend's non-200 answer as the client's error: 4xx passed on, 5xx and auth failures as 502."""
    try:
        err = orjson.loads(body).get("error") or {}
        message = str(err.get("message") or "")
        code = err.get("code")
        param = err.get("param")
        etype = err.get("type") or "invalid_request_error"
    except (orjson.JSONDecodeError, AttributeError):
        message, code, param, etype = "", None, None, "api_error"
    if 400 <= status < 500 and status not in (401, 403, 407):
        headers = {"retry-after": "1"} if status == 429 else None
        return APIError(status, message or f"The backend refused the request (HTTP {status}).", type=etype, code=code, param=param, headers=headers)
    return APIError(
        502,
        f"The backend for model '{model}' failed (HTTP {status}). Retry shortly.",
        type="api_error",
        code="upstream_error",
    )


def upstream_broken(model: str, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"The backend for model '{model}' broke off its answer ({type(exc).__name__}). Retry the request.",
        type="api_error",
        code="upstream_error",
    )


class CompletionsEndpoint:
    """POST handler for chat and text completions."""

    def __init__(self, gateway: Gateway, kind: Kind) -> None:
        self.gw = gateway
        self.kind = kind
        self.path = UPSTREAM_PATH[kind]
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.classes = gateway.settings.queue.classes
        # models whose balancing policy reads the prompt's prefix (only their prompts are hashed), with
        # the tokenizer that hashes them in the engine's token blocks (None: text blocks)
        self.prefix_models = {
            name: pool.prompt_tokenizer
            for name, pool in gateway.cluster.pools.items()
            if getattr(pool.policy, "name", "") in PREFIX_POLICIES
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        timer = PathTimer(now_ns())
        request_id = next_request_id()
        if gw.probing:
            probes.CURRENT.set(timer)  # the upstream trace hooks stamp this request's timer
        try:
            raw = await read_body(scope, receive, gw.settings.max_body_bytes)
            inbound = parse_request(self.kind, raw, header(scope, b"x-session-id"))
            principal = await gw.ops.authenticate(bearer_token(scope))
            reserve_as = inbound.model
            model = gw.settings.models.get(reserve_as)
            if model is None and gw.fusion is not None and gw.fusion.is_virtual(reserve_as):
                # a route is admitted against its dearer model: the reservation is an upper bound
                reserve_as = gw.fusion.reservation_model(reserve_as)
                model = gw.settings.models[reserve_as]
            if model is None:
                raise model_not_found(inbound.model, [*gw.settings.models, *gw.settings.routes])
            inbound.check_context(model.context_window)
            # a cascade or ensemble reserves its worst case: every step, each at its model's price
            fused = fusion_exec.reservation(gw, inbound.model)
            admission = await gw.ops.admit(
                principal,
                AdmissionRequest(
                    model=reserve_as,
                    prompt_tokens_upper=inbound.prompt_tokens_upper(model.template_overhead_tokens) + fused.extra_prompt_tokens,
                    max_tokens=inbound.max_tokens * inbound.choices if inbound.max_tokens else None,
                    context_window=model.context_window,
                    session_id=inbound.session_id,
                    fingerprint=inbound.fingerprint,
                    price=fused.price,
                ),
            )
            inbound.cap_reasoning(admission.max_reasoning_tokens, model.reasoning_budget_field)
        except ClientGone:
            return
        except APIError as err:
            gw.metrics.refused(err.code or err.type)
            await send_error(send, err, request_id)
            return
        except Exception:
            log.exception("request %s failed before admission", request_id)
            await send_error(send, internal_error(), request_id)
            return
        await self._serve(scope, receive, send, inbound, admission, timer, request_id, reserve_as != inbound.model)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        inbound: InboundRequest,
        admission: Admission,
        timer: PathTimer,
        request_id: str,
        virtual: bool = False,
    ) -> None:
        gw = self.gw
        exchange = Exchange(gw.ops, admission, inbound, timer, model_served=inbound.model)
        query: CacheQuery | None = None  # set while the answer may still be stored
        stored: dict[str, Any] | bytes | None = None  # the whole answer, to store after settling
        response_started = False
        try:
            cache = gw.cache
            if cache is not None:
                query = cache.query(
                    CacheScope(admission.principal.tenant, inbound.model),
                    inbound,
                    directive_from_headers(header(scope, b"cache-control"), header(scope, b"x-tokenops-cache")),
                )
                hit = await cache.lookup_query(query)
                if hit is not None:
                    query = None
                    await self._answer_from_cache(send, inbound, exchange, hit, request_id)
                    response_started = True
                    return
                if not query.store_ok:
                    query = None
            route_header: bytes | None = None
            if virtual:
                plan = await self._plan(scope, inbound, admission)
                exchange.route = plan.header()
                route_header = exchange.route.encode("latin-1", "replace")
                inbound.model = exchange.model_served = plan.model  # the cache keeps the route's name
            per_choice = admission.max_output_tokens // max(inbound.choices, 1)
            if per_choice < 1:
                raise budget_exhausted(0)
            requested = inbound.max_tokens
            if requested is None:
                max_tokens = per_choice if admission.budget_limited else None
            else:
                max_tokens = min(requested, per_choice)
            exchange.max_tokens_sent = max_tokens
            exchange.budget_cut = admission.budget_limited and max_tokens is not None and (
                requested is None or max_tokens < requested
            )
            if exchange.budget_cut:
                query = None  # an answer shortened by the budget is not the answer to the request
            if virtual and plan.strategy != "single":
                run = fusion_exec.FusedRun(
                    self, receive, send, exchange, plan, max_tokens, request_id,
                    collect=query is not None, cache_miss=query is not None and query.bypass is None,
                )
                try:
                    stored = await run.serve()
                finally:
                    response_started = run.started
                return  # the finally below settles; the cache stores the answer after it
            priority = admission.priority
            prefix = self.prefix_models
            hashes, block_tokens = (
                inbound.prompt_blocks(prefix[inbound.model]) if inbound.model in prefix else ((), PREFIX_BLOCK_TOKENS)
            )
            info = RequestInfo(
                model=inbound.model,
                session_id=inbound.session_id,
                block_hashes=hashes,
                block_tokens=block_tokens,
                prompt_tokens=inbound.prompt_tokens_estimate(),
                max_tokens=max_tokens or 0,
                priority=priority,
            )
            line = self.classes[min(max(priority, 0), len(self.classes) - 1)]

            def upstream_body(served: str) -> bytes:
                # called by the cluster just before each try goes out: the end of the gateway's own path
                body = inbound.upstream_body(served, max_tokens)
                exchange.sent_upstream = True
                timer.sent()
                return body

            # watched from the wait for a slot to the last byte: a client gone at any point cancels
            # the upstream call at once (the replica stops and frees its slot)
            watch = ClientWatch(receive)
            async with watch, gw.cluster.open(
                info,
                self.path,
                upstream_body,
                {"x-request-id": request_id, "x-priority": str(priority)},
                budget_left=admission.budget_left,
                max_wait=line.max_wait_s,
                max_queued=line.max_queued,
            ) as up:
                timer.upstream_in = now_ns()
                exchange.model_served = up.model
                exchange.degraded = up.degraded
                if up.status != 200:
                    raise _upstream_error(up.status, await up.read(), inbound.model)
                headers = base_headers(request_id, [(b"x-tokenops-model", up.model.encode("latin-1", "replace"))])
                if up.degraded:
                    headers.append((DEGRADED, up.degraded.encode("latin-1", "replace")))
                if route_header is not None:
                    headers.append((b"x-tokenops-route", route_header))
                if query is not None and query.bypass is None:
                    headers.extend(MISS_HEADERS)
                if gw.probing:
                    headers.append(probes.timing_header(timer, up.headers.get("x-stub-timing")))
                if inbound.stream:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [SSE_CT, (b"cache-control", b"no-cache"), *headers],
                        }
                    )
                    response_started = True
                    collected: list[dict[str, Any]] | None = [] if query is not None else None
                    await relay(up.aiter_bytes(), send, exchange, watch.client_gone, collected)
                    watch.disarm()
                    if collected:
                        stored = assemble_stream(collected)
                else:
                    data = await up.read()
                    timer.upstream_in = timer.last_in = now_ns()
                    try:
                        obj = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        raise _upstream_error(502, b"", inbound.model) from None
                    if isinstance(obj, dict):
                        exchange.observe(obj)
                    if exchange.stopped_by_budget:
                        exchange.fail("budget_exhausted", 200, "budget_exhausted")
                        headers.append((b"x-tokenops-budget-exhausted", b"true"))
                    response_started = True
                    watch.disarm()
                    await send_bytes(send, 200, data, headers)
                    timer.finished()
                    stored = data
            if watch.gone:
                exchange.fail("client_disconnected", 499, "client_disconnected")
        except APIError as err:
            gw.metrics.refused(err.code or err.type)
            exchange.fail("upstream_error" if err.status >= 500 else "error", err.status, err.code)
            if not response_started:
                await send_error(send, err, request_id)
        except (UpstreamBroken, aiohttp.ClientError, OSError, TimeoutError) as exc:
            # the replica broke while a whole (non-streamed) answer was being read
            exchange.fail("upstream_error", 502, "upstream_error")
            if not response_started:
                await send_error(send, upstream_broken(inbound.model, exc), request_id)
        except Exception:
            log.exception("request %s failed after admission", request_id)
            if exchange.status == "ok":
                exchange.fail("error", 500, "internal_error")
            if not response_started:
                await send_error(send, internal_error(), request_id)
        finally:
            settle_from = now_ns()
            row = await exchange.settle()
            settle_ns = now_ns() - settle_from
            outcome = exchange.settled_outcome
            if outcome is not None:
                gw.metrics.settled(inbound.model, admission.principal.tenant, outcome, row.cost_micros if row else 0)
            gw.metrics.timed(inbound.model, timer, settle_ns)
            if query is not None and stored is not None and exchange.status == "ok" and gw.cache is not None:
                # after the client has its answer and the ledger its row: storing never delays either
                await gw.cache.store_query(query, stored)

    async def _plan(self, scope: Scope, inbound: InboundRequest, admission: Admission) -> Any:
        """fusion.plan for a virtual model: rules score in microseconds on the loop; the kNN and
        learned routers embed the prompt (a few ms), so they run in a worker thread."""
        fusion = self.gw.fusion
        task = header(scope, b"x-tokenops-task")
        if fusion.routes[inbound.model].router.name == "rules":
            return fusion.plan(inbound, admission, task=task)
        return await asyncio.to_thread(fusion.plan, inbound, admission, task=task)

    async def _answer_from_cache(
        self, send: Send, inbound: InboundRequest, exchange: Exchange, hit: CachedResponse, request_id: str
    ) -> None:
        """Serve a hit as JSON or SSE; the ledger row carries no engine tokens and status cache_hit."""
        exchange.fail("cache_hit", 200, None)
        exchange.first_token_at = time.perf_counter()
        model = str(hit.body.get("model") or inbound.model)
        exchange.model_served = model
        choices = hit.body.get("choices") or ()
        exchange.finish_reason = choices[0].get("finish_reason") if choices else None
        headers = base_headers(request_id, [*hit.headers(), (b"x-tokenops-model", model.encode("latin-1", "replace"))])
        response_id = self.id_prefix + request_id
        if inbound.stream:
            body = encode_chunks(hit.chunks(include_usage=inbound.client_wants_usage, response_id=response_id))
            await send_bytes(send, 200, body, [(b"cache-control", b"no-cache"), *headers], SSE_CT)
        else:
            await send_bytes(send, 200, orjson.dumps(hit.completion(response_id=response_id)), headers)


class ModelsEndpoint:
    """GET /v1/models and /v1/models/{id}: the configured models (authenticated, like OpenAI's)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = next_request_id()
        try:
            await self.gw.ops.authenticate(bearer_token(scope))
            names = [*self.gw.settings.models, *self.gw.settings.routes]
            path = scope["path"]
            if path.rstrip("/") == "/v1/models":
                data = [self._card(n) for n in names]
                await send_json(send, 200, {"object": "list", "data": data}, base_headers(request_id))
                return
            name = path[len("/v1/models/") :]
            if name not in names:
                raise model_not_found(name, names)
            await send_json(send, 200, self._card(name), base_headers(request_id))
        except APIError as err:
            await send_error(send, err, request_id)
        except Exception:
            log.exception("request %s failed listing models", request_id)
            await send_error(send, internal_error(), request_id)

    def _card(self, name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": self.gw.started_at, "owned_by": "tokenops"}
