"""The public OpenAI endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

This module owns the order of the request path and its guarantees: read and validate the body
(request.py), then the stages of stages.py one after the other, each handing the next one typed
object: authenticate -> admit -> lookup (a hit is answered here and settled with no engine tokens)
-> plan -> dispatch -> settle -> store. Every refusal is an OpenAI error; once a request is admitted,
whatever happens, it settles exactly once in a `finally`, and then the gateway's own time on it
(timing.py) goes to the metrics.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenops.cache import directive_from_headers
from tokenops.cache.scope import CacheQuery
from tokenops.gateway import probes, stages
from tokenops.gateway.exchange import Exchange
from tokenops.gateway.http import (
    ClientGone,
    Receive,
    Scope,
    Send,
    base_headers,
    bearer_token,
    header,
    next_request_id,
    read_body,
    send_error,
    send_json,
)
from tokenops.gateway.reply import Reply
from tokenops.gateway.request import Kind, parse_request
from tokenops.gateway.timing import PathTimer, now_ns
from tokenops.gateway.upstream import UPSTREAM_FAULTS, upstream_broken
from tokenops.protocol import APIError, model_not_found

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway

log = logging.getLogger("tokenops.gateway")


def internal_error() -> APIError:
    return APIError(
        500,
        "The gateway failed to process the request. Retry; the operator has the log.",
        type="api_error",
        code="internal_error",
    )


class CompletionsEndpoint:
    """POST handler for chat and text completions."""

    def __init__(self, gateway: Gateway, kind: Kind) -> None:
        self.gw = gateway
        self.kind = kind
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        timer = PathTimer(now_ns())
        request_id = next_request_id()
        if gw.probing:
            probes.CURRENT.set(timer)  # the upstream trace hooks stamp this request's timer
        try:
            raw = await read_body(scope, receive, gw.settings.max_body_bytes)
            inbound = parse_request(self.kind, raw, header(scope, b"x-session-id"))
            directive = (
                directive_from_headers(header(scope, b"cache-control"), header(scope, b"x-tokenops-cache"))
                if gw.cache is not None
                else None
            )
            arrival = stages.Arrival(
                inbound, bearer_token(scope), directive, header(scope, b"x-tokenops-task")
            )
            admitted = await stages.admit(gw, await stages.authenticate(gw.ops, arrival))
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
        await self.serve(
            admitted,
            Reply(
                send,
                receive,
                request_id,
                Exchange(admitted.admission, inbound, timer, model_served=inbound.model),
            ),
        )

    async def serve(self, admitted: stages.Admitted, reply: Reply) -> None:
        """Everything after admission; the `finally` settles, whatever happened, then stores. The
        Responses and compaction calls enter here too, with their own `Reply`."""
        gw = self.gw
        exchange = reply.exchange
        query: CacheQuery | None = None
        answer: dict[str, Any] | bytes | None = None
        reply.settle = lambda: exchange.settle(gw.ops)
        try:
            found = await stages.lookup(gw, admitted)
            if found.hit is not None:
                await reply.cached(found.hit, self.id_prefix + reply.request_id)
                return
            query = found.query
            planned = await stages.plan(gw, admitted)
            exchange.max_tokens_sent = planned.max_tokens
            exchange.budget_cut = planned.budget_cut
            if planned.budget_cut:
                query = None  # an answer shortened by the budget is not the answer to the request
            reply.cache_miss = query is not None and query.bypass is None
            answer = await stages.dispatch(
                gw, stages.Dispatch(admitted, planned, reply, collect=query is not None)
            )
        except APIError as err:
            gw.metrics.refused(err.code or err.type)
            exchange.fail("upstream_error" if err.status >= 500 else "error", err.status, err.code)
            await reply.error(err)
        except UPSTREAM_FAULTS as exc:
            # the replica broke while a whole (non-streamed) answer was being read
            exchange.fail("upstream_error", 502, "upstream_error")
            await reply.error(upstream_broken(exchange.model or admitted.inbound.model, exc))
        except Exception:
            log.exception("request %s failed after admission", reply.request_id)
            if exchange.status == "ok":
                exchange.fail("error", 500, "internal_error")
            await reply.error(internal_error())
        finally:
            try:
                await stages.settle(gw, exchange)
            finally:
                if admitted.slot is not None:
                    admitted.slot.release()  # settled: the next waiter of its line may go
            await stages.store(gw, stages.Store(query, answer, exchange))


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
