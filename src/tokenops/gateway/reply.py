"""The response to one client: its headers, whether it has started, and the ways an answer leaves.

This module owns the response headers of an answer (request id, the model that served, degradation,
the route trace, the cache's miss headers), and writing an answer: a backend's response relayed as it
comes (SSE through sse.py, or a whole body as the bytes it came in), a buffered answer (JSON, or
replayed as SSE to a streaming client), a cache hit, or an error before anything was sent. Each
accounts what it sends in the request's `Exchange`. It does not open calls (upstream.py) or settle.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from tokenops.cache import MISS_HEADERS, CachedResponse, assemble_stream
from tokenops.cache.response import completion_chunks
from tokenops.cluster import DEGRADE_HEADER, Upstream
from tokenops.fusion.executor import Answer
from tokenops.gateway import probes
from tokenops.gateway.client_watch import ClientWatch
from tokenops.gateway.exchange import Exchange
from tokenops.gateway.http import SSE_CT, Receive, Send, base_headers, send_bytes, send_error
from tokenops.gateway.sse import encode_chunks, gather, relay
from tokenops.gateway.timing import now_ns
from tokenops.gateway.upstream import upstream_error
from tokenops.protocol import APIError

DEGRADED = DEGRADE_HEADER.lower().encode("latin-1")
BUDGET_EXHAUSTED = (b"x-tokenops-budget-exhausted", b"true")


def _latin1(value: str) -> bytes:
    return value.encode("latin-1", "replace")


class Reply:
    """The one response of one request. `started` turns true with its first byte: from then on an
    error can only end the stream, never replace the response."""

    def __init__(self, send: Send, receive: Receive, request_id: str, exchange: Exchange) -> None:
        self.send = send
        self.receive = receive
        self.request_id = request_id
        self.exchange = exchange
        self.started = False
        self.cache_miss = False  # the answer may be stored: say so in the cache's headers
        # settles the exchange (its row committed); awaited before the last byte of an answer whose
        # account is complete when its backend's response ends, so a client with a whole answer
        # has its ledger row even if the gateway dies right after
        self.settle: Callable[[], Awaitable[object]] | None = None

    def headers(self, model: str, degraded: str | None, route: str | None) -> list[tuple[bytes, bytes]]:
        headers = base_headers(self.request_id, [(b"x-tokenops-model", _latin1(model))])
        if degraded:
            headers.append((DEGRADED, _latin1(degraded)))
        if route is not None:
            headers.append((b"x-tokenops-route", _latin1(route)))
        if self.cache_miss:
            headers.extend(MISS_HEADERS)
        return headers

    async def error(self, err: APIError) -> None:
        """Send `err` as the response, unless the response has already started."""
        if not self.started:
            await send_error(self.send, err, self.request_id)

    async def relay(
        self,
        up: Upstream,
        route: str | None,
        watch: ClientWatch,
        *,
        collect: bool,
        timed: bool,
        probing: bool,
        complete: bool = False,
    ) -> dict[str, Any] | bytes | None:
        """Relay an opened 200 response as it comes: a stream event by event, a whole body as its
        bytes, while `watch` ends it if the client goes away. Returns the whole answer when
        `collect` (for the cache). `timed`: the request's path timer takes the upstream stamps (a
        single-model request). `complete`: nothing is billed beyond this response, so `settle` runs
        before its last byte."""
        settle = self.settle if complete else None
        ex = self.exchange
        timer = ex.timer
        if timed:
            timer.upstream_in = now_ns()
            if not timer.upstream_sent:
                timer.upstream_sent = up.sent_at
        ex.model_served = up.model
        ex.degraded = up.degraded
        headers = self.headers(up.model, up.degraded, route)
        if probing and timed:
            headers.append(probes.timing_header(timer, up.headers.get("x-stub-timing")))
        if ex.inbound.stream:
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [SSE_CT, (b"cache-control", b"no-cache"), *headers],
                }
            )
            self.started = True
            collected: list[dict[str, Any]] | None = [] if collect else None
            await relay(up.aiter_bytes(), self.send, ex, watch.client_gone, collected, settle)
            watch.disarm()
            return assemble_stream(collected) if collected else None
        if up.headers.get("content-type", "").startswith("text/event-stream"):
            # streamed from the backend for a whole answer (ServedModel.stream_upstream)
            whole = assemble_stream(await gather(up.aiter_bytes(), ex))
            timer.upstream_in = timer.last_in = now_ns()
            if whole is None:
                raise upstream_error(502, b"", up.model)
            data = orjson.dumps(whole)
        else:
            data = await up.read()
            timer.upstream_in = timer.last_in = now_ns()
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise upstream_error(502, b"", up.model) from None
            if isinstance(obj, dict):
                ex.observe(obj)
        if ex.stopped_by_budget:
            ex.fail("budget_exhausted", 200, "budget_exhausted")
            headers.append(BUDGET_EXHAUSTED)
        if settle is not None:
            await settle()
        self.started = True
        watch.disarm()  # uvicorn reports a disconnect once a response is complete, too
        await send_bytes(self.send, 200, data, headers)
        timer.finished()
        return data

    async def whole(self, ans: Answer, route: str, *, keep_logprobs: bool) -> dict[str, Any]:
        """Send a buffered answer: JSON, or replayed as SSE to a streaming client. Log-probs the
        client did not ask for (a check asked for them) are dropped."""
        obj = ans.obj
        assert obj is not None
        ex = self.exchange
        ex.degraded = ans.degraded
        ex.observe(obj)
        ex.model_served = ans.model
        if not keep_logprobs:
            for c in obj.get("choices") or ():
                c["logprobs"] = None
        headers = self.headers(ans.model, ans.degraded, route)
        if ex.stopped_by_budget:
            ex.fail("budget_exhausted", 200, "budget_exhausted")
            headers.append(BUDGET_EXHAUSTED)
        self.started = True
        if ex.inbound.stream:
            body = encode_chunks(completion_chunks(obj, include_usage=ex.inbound.client_wants_usage))
            await send_bytes(self.send, 200, body, [(b"cache-control", b"no-cache"), *headers], SSE_CT)
        else:
            await send_bytes(self.send, 200, orjson.dumps(obj), headers)
        return obj

    async def cached(self, hit: CachedResponse, response_id: str) -> None:
        """Serve a hit as JSON or SSE; the ledger row carries no engine tokens and status cache_hit."""
        ex = self.exchange
        ex.fail("cache_hit", 200, None)
        ex.first_token_at = time.perf_counter()
        model = str(hit.body.get("model") or ex.inbound.model)
        ex.model_served = model
        choices = hit.body.get("choices") or ()
        ex.finish_reason = choices[0].get("finish_reason") if choices else None
        headers = base_headers(self.request_id, [*hit.headers(), (b"x-tokenops-model", _latin1(model))])
        self.started = True
        if ex.inbound.stream:
            body = encode_chunks(
                hit.chunks(include_usage=ex.inbound.client_wants_usage, response_id=response_id)
            )
            await send_bytes(self.send, 200, body, [(b"cache-control", b"no-cache"), *headers], SSE_CT)
        else:
            await send_bytes(self.send, 200, orjson.dumps(hit.completion(response_id=response_id)), headers)
