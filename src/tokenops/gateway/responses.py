"""`/v1/responses`: OpenAI's Responses API, with the gateway holding an agent's memory.

A Responses request becomes a chat completion (responses_wire.py) and takes the chat path whole:
authenticate, admit, cache, plan, the cluster, settle (its ledger row says `operation=responses`).
Only the client's side differs: the chat answer, whole or streamed, is written back as a response
object or as Responses events by `ResponseSink`, an ASGI `send` in front of the client's.

`previous_response_id` resends the stored history of the tenant's own response (another tenant's
id, an unknown or an expired one: 404), under the chain's first response id as the session, so the
cluster's session affinity and the engine's prefix cache serve the repeated head. When the next
prompt would outgrow its budget (the window's share, the gateway's `responses.max_history_tokens` or
the tenant tree's `max_history_tokens`), `CompactionPolicy` cuts the history and the compaction model
summarises the older part in one call of its own (metered on its own row, `operation=compaction`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from tokenops.cache import directive_from_headers
from tokenops.gateway import stages
from tokenops.gateway.compaction import (
    SUMMARY_INSTRUCTIONS,
    CompactionPolicy,
    SessionSnapshot,
    message_bytes,
    summary_message,
    transcript,
    truncated_message,
)
from tokenops.gateway.exchange import Exchange
from tokenops.gateway.http import (
    ClientGone,
    Message,
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
from tokenops.gateway.request import parse_request
from tokenops.gateway.responses_wire import (
    Finished,
    ResponseShape,
    ResponsesRequest,
    StreamTranslator,
    chat_body,
    encode_event,
    from_completion,
    input_messages,
    new_item_id,
    not_found,
    parse_responses_request,
)
from tokenops.gateway.sse import DONE, SSEDecoder
from tokenops.gateway.timing import PathTimer, now_ns
from tokenops.ops.domain import Principal
from tokenops.ops.responses_store import StoredResponse, delete_response, find_response, save_response
from tokenops.protocol import APIError, model_not_found

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway
    from tokenops.gateway.routes import CompletionsEndpoint

log = logging.getLogger("tokenops.gateway")

# bytes per token of the estimate for the new input (request.py's realistic guess)
BYTES_PER_TOKEN = 4
# chat template tokens around the compaction call's two messages
TEMPLATE_MARGIN_TOKENS = 48
# of the room the transcript may fill: the tokens-per-byte ratio is a session average, not a bound
TRANSCRIPT_SHARE = 0.8
OnFinished = Callable[[Finished], Awaitable[None]]


def _strip(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k not in (b"content-type", b"content-length")]


class ResponseSink:
    """The chat path's ASGI send, writing a response object or Responses events to the client."""

    def __init__(self, send: Send, shape: ResponseShape, on_finished: OnFinished) -> None:
        self.send = send
        self.shape = shape
        self.on_finished = on_finished
        self.start: Message | None = None
        self.streaming = False
        self.done = False
        self.body = bytearray()
        self.decoder = SSEDecoder()
        self.translator = StreamTranslator(shape)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            ctype = dict(message.get("headers") or ()).get(b"content-type", b"")
            if message["status"] == 200 and ctype.startswith(b"text/event-stream"):
                self.streaming = True
                headers = [(b"content-type", b"text/event-stream"), *_strip(message["headers"])]
                await self.send({"type": "http.response.start", "status": 200, "headers": headers})
                await self._events(self.translator.start(), more=True)
            return
        if message["type"] != "http.response.body":
            return
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if self.streaming:
            await self._stream(chunk, more)
            return
        self.body += chunk
        if more:
            return
        assert self.start is not None
        if self.start["status"] != 200:  # an OpenAI error: passed on as it is
            await self.send(self.start)
            await self.send({"type": "http.response.body", "body": bytes(self.body)})
            return
        finished = from_completion(self.shape, orjson.loads(bytes(self.body)))
        await self.on_finished(finished)
        data = orjson.dumps(finished.body)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            *_strip(self.start["headers"]),
        ]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})

    async def _stream(self, chunk: bytes, more: bool) -> None:
        events: list[dict[str, Any]] = []
        for data in self.decoder.feed(chunk) + ([] if more else self.decoder.flush()):
            if self.done:
                break
            if data == DONE:
                events += await self._finish()
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
                events += self.translator.failed(obj.get("error") or {})
                self.done = True
            elif isinstance(obj, dict):
                events += self.translator.feed(obj)
        if not more and not self.done:
            events += await self._finish()
        await self._events(events, more=more)

    async def _finish(self) -> list[dict[str, Any]]:
        self.done = True
        events, finished = self.translator.finish()
        await self.on_finished(finished)
        return events

    async def _events(self, events: list[dict[str, Any]], *, more: bool) -> None:
        if events or not more:
            body = b"".join(encode_event(e) for e in events)
            await self.send({"type": "http.response.body", "body": body, "more_body": more})


class CaptureSend:
    """An internal call's ASGI send: keeps the status and the body."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


async def _never() -> Message:
    await asyncio.Future()  # an internal call has no client to go away
    raise AssertionError("unreachable")


class ResponsesEndpoint:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}."""

    def __init__(self, gateway: Gateway, chat: CompletionsEndpoint) -> None:
        self.gw = gateway
        self.chat = chat
        r = gateway.settings.responses
        self.policy = CompactionPolicy(r.compact_at, r.max_history_tokens, r.keep_recent, r.summary_tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = next_request_id()
        path = scope["path"].rstrip("/")
        try:
            if path == "/v1/responses":
                await self._create(scope, receive, send, request_id)
                return
            response_id = path[len("/v1/responses/") :]
            principal = await self.gw.ops.authenticate(bearer_token(scope))
            if scope["method"] == "DELETE":
                if not await self.gw.ops.db.run(delete_response, response_id, principal.tenant):
                    raise not_found(response_id, expired=False, param=None)
                body = {"id": response_id, "object": "response.deleted", "deleted": True}
                await send_json(send, 200, body, base_headers(request_id))
                return
            stored = await self._find(principal, response_id, param=None)
            await send_json(send, 200, stored.body, base_headers(request_id))
        except ClientGone:
            return
        except APIError as err:
            self.gw.metrics.refused(err.code or err.type)
            await send_error(send, err, request_id)
        except Exception:
            from tokenops.gateway.routes import internal_error

            log.exception("request %s failed on %s", request_id, path)
            await send_error(send, internal_error(), request_id)

    async def _find(self, principal: Principal, response_id: str, param: str | None) -> StoredResponse:
        stored, expired = await self.gw.ops.db.run(find_response, response_id, principal.tenant)
        if stored is None:
            raise not_found(response_id, expired=expired, param=param)
        return stored

    def _window(self, model: str) -> tuple[int, str]:
        """The context window a session on `model` lives in, and the compaction model."""
        settings = self.gw.settings
        configured = settings.responses.compaction_model
        if model in settings.models:
            return settings.models[model].context_window, configured or model
        route = settings.routes.get(model)
        if route is None:
            raise model_not_found(model, [*settings.models, *settings.routes])
        window = min(settings.models[m].context_window for m in (route.cheap, route.strong))
        return window, configured or route.cheap

    async def _create(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        gw = self.gw
        timer = PathTimer(now_ns())
        raw = await read_body(scope, receive, gw.settings.max_body_bytes)
        req = parse_responses_request(raw)
        api_key = bearer_token(scope)
        principal = await gw.ops.authenticate(api_key)
        window, compaction_model = self._window(req.model)
        new = input_messages(req.input)
        previous = (
            await self._find(principal, req.previous_response_id, "previous_response_id")
            if req.previous_response_id
            else None
        )
        response_id = new_item_id("resp")
        session = header(scope, b"x-session-id") or (previous.session_id if previous else response_id)
        history = list(previous.history) if previous else []
        head = [{"role": "system", "content": req.instructions}] if req.instructions else []
        new_tokens = sum(message_bytes(m) for m in head + new) // BYTES_PER_TOKEN
        snapshot = SessionSnapshot(
            tuple(history),
            previous.history_tokens if previous else 0,
            new_tokens,
            window,
            req.max_output_tokens or window // 4,
            await gw.ops.history_budget(principal),
        )
        cut = self.policy.decide(snapshot)
        if cut is not None:
            summary = await self._summarise(
                principal, api_key, compaction_model, history[: cut.split], session, cut.tokens_per_byte
            )
            history = [summary, *history[cut.split :]]
        messages = head + history + new
        body = chat_body(req, req.model, messages)
        inbound = parse_request("chat", orjson.dumps(body), session)
        directive = (
            directive_from_headers(header(scope, b"cache-control"), header(scope, b"x-tokenops-cache"))
            if gw.cache is not None
            else None
        )
        arrival = stages.Arrival(inbound, api_key, directive, header(scope, b"x-tokenops-task"))
        admitted = await stages.admit(gw, stages.Authenticated(arrival, principal))
        shape = ResponseShape(response_id, req.model, req)

        async def on_finished(finished: Finished) -> None:
            if not req.store:
                return
            usage = finished.usage or {}
            tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            now = datetime.now(UTC)
            record = StoredResponse(
                id=response_id,
                tenant=principal.tenant,
                key_id=principal.key_id,
                model=req.model,
                session_id=session,
                previous_response_id=req.previous_response_id,
                body=finished.body,
                history=[*history, *new, finished.message],
                history_tokens=tokens or inbound.prompt_tokens_estimate(),
                created_at=now,
                expires_at=now + timedelta(seconds=gw.settings.responses.ttl_s),
            )
            try:
                await gw.ops.db.run(save_response, record)
            except Exception:
                log.exception("storing response %s failed", response_id)

        exchange = Exchange(
            admitted.admission, inbound, timer, model_served=inbound.model, operation="responses"
        )
        await self.chat.serve(
            admitted, Reply(ResponseSink(send, shape, on_finished), receive, request_id, exchange)
        )

    async def _summarise(
        self,
        principal: Principal,
        api_key: str | None,
        model: str,
        older: list[dict[str, Any]],
        session: str,
        tokens_per_byte: float,
    ) -> dict[str, Any]:
        """One call on the compaction model through the chat path (its own ledger row); should it
        fail, the older turns are dropped and a note stands for them."""
        gw = self.gw
        window = self._window(model)[0]
        summary_tokens = gw.settings.responses.summary_tokens
        # the transcript fills what the window leaves after the instructions and the summary, with a
        # margin for the template, at the session's own tokens per byte
        room = window - summary_tokens - len(SUMMARY_INSTRUCTIONS) * tokens_per_byte - TEMPLATE_MARGIN_TOKENS
        max_chars = max(int(TRANSCRIPT_SHARE * room / max(tokens_per_byte, 0.05)), 64)
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SUMMARY_INSTRUCTIONS},
                {"role": "user", "content": transcript(older, max_chars)},
            ],
            "max_tokens": summary_tokens,
            "temperature": 0,
        }
        request_id = next_request_id()
        capture = CaptureSend()
        try:
            inbound = parse_request("chat", orjson.dumps(body), session + ":compaction")
            arrival = stages.Arrival(inbound, api_key, None, None)
            admitted = await stages.admit(gw, stages.Authenticated(arrival, principal))
            exchange = Exchange(
                admitted.admission, inbound, PathTimer(now_ns()), model_served=model, operation="compaction"
            )
            await self.chat.serve(admitted, Reply(capture, _never, request_id, exchange))
            if capture.status == 200:
                obj = orjson.loads(bytes(capture.body))
                text = ((obj.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
                if text.strip():
                    return summary_message(text)
            log.warning(
                "compaction call %s answered %d (%s): older turns dropped",
                request_id,
                capture.status,
                bytes(capture.body[:300]).decode(errors="replace"),
            )
        except APIError as err:
            log.warning("compaction call %s refused (%s): older turns dropped", request_id, err.code)
        return truncated_message(len(older))


__all__ = ["ResponsesEndpoint", "ResponseSink", "ResponsesRequest"]
