"""The SSE relay: reads a backend's event stream, accounts each chunk in the `Exchange`, and writes
it to the client as it comes.

This module owns the server-sent-events framing on both sides, dropping the usage-only final chunk
the gateway asked for on its own account (kept when the client asked for usage too), and the final
error events: the budget ran out mid-generation, or the backend broke off the stream. It stops
promptly when the client goes away (`ClientWatch` cancels the request's task, which ends the
pending read), and stamps the exchange's `PathTimer` per read. It does not decide whether to stream or how
to settle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from tokenops.cluster.dispatch import UpstreamBroken
from tokenops.gateway.exchange import Exchange
from tokenops.gateway.timing import now_ns
from tokenops.protocol import APIError

DONE = b"[DONE]"
Send = Callable[[dict[str, Any]], Any]


_TEXT_KEYS = (b'"content":"', b'"reasoning_content":"', b'"text":"')


def quick_tokens(data: bytes) -> int | None:
    """Read a mid-stream chunk without parsing it: 1 when it carries generated text, 0 when not, None
    when it must be parsed. Only the compact shape every OpenAI-compatible server streams qualifies:
    one choice, `"finish_reason":null`, no usage (or `"usage":null`), no error, no logprobs, no tool
    calls (`"tool_calls":null`, as pydantic-serialising servers write it, is none), one JSON object.
    Anything else (the finish and usage chunks, errors, spaced JSON, a cut-off object) returns None.

    In JSON text an unescaped `"` is structure, never string content, so a key found by its quoted
    name is a key (a token that spells `"usage"` arrives as `\"usage\"`)."""
    if (
        not (data.startswith(b"{") and data.endswith(b"}"))
        or b'"finish_reason":null' not in data
        or b'"error"' in data
    ):
        return None
    if not (_null_or_absent(data, b'"usage"') and _null_or_absent(data, b'"tool_calls"')):
        return None
    if data.count(b'"index":') != 1:
        return None  # several choices (tool calls' entries have indexes too, but they were refused above)
    at = data.find(b'"logprobs"')
    if at >= 0 and not data.startswith(b'"logprobs":null', at):
        return None
    for key in _TEXT_KEYS:
        at = data.find(key)
        if at >= 0 and data[at + len(key) : at + len(key) + 1] != b'"':
            return 1
    return 0


def _null_or_absent(data: bytes, key: bytes) -> bool:
    """`key` (quoted) does not occur in `data`, or occurs once as `key:null`."""
    at = data.find(key)
    return at < 0 or (data.startswith(key + b":null", at) and data.find(key, at + len(key)) < 0)


def single_quick_event(chunk: bytes) -> int | None:
    """`quick_tokens` of a read that is exactly one event of one `data: ` line (`data: {...}\n\n`, no
    CR), which can then be relayed as it came; None for any other read (the decoder takes it)."""
    if (
        chunk.startswith(b"data: ")
        and chunk.find(b"\n") == len(chunk) - 2
        and chunk.endswith(b"\n\n")
        and b"\r" not in chunk
    ):
        return quick_tokens(chunk[6:-2])
    return None


def encode_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def error_event(err: APIError) -> bytes:
    return encode_event(orjson.dumps(err.body()))


def budget_exhausted(max_tokens: int | None) -> APIError:
    return APIError(
        429,
        f"The budget ran out: generation stopped at {max_tokens} tokens, all the remaining budget allowed. "
        "Raise the budget or wait for the next budget period.",
        type="insufficient_quota",
        code="budget_exhausted",
    )


class StreamCut(APIError):
    """A backend's stream ended before its answer was complete."""


def stream_broken() -> APIError:
    return StreamCut(
        502,
        "The backend ended the stream before the response was complete. Retry the request.",
        type="api_error",
        code="upstream_error",
    )


class SSEDecoder:
    """Splits a byte stream into the `data:` payloads of its events (multi-line data joined)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            start = end + 2
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(event[5:].strip())  # the common case: one data line
                continue
            lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        self._buf = buf[start:]
        return out

    @property
    def idle(self) -> bool:
        """No partial event is held from an earlier read."""
        return not self._buf

    def flush(self) -> list[bytes]:
        rest, self._buf = self._buf.strip(), b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


async def iter_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data:` payload of each event in a byte stream."""
    decoder = SSEDecoder()
    async for chunk in chunks:
        for data in decoder.feed(chunk):
            yield data
    for data in decoder.flush():
        yield data


async def relay(
    chunks: AsyncIterator[bytes],
    send: Send,
    exchange: Exchange,
    client_gone: Callable[[], bool],
    collect: list[dict[str, Any]] | None = None,
    settle: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Relay the backend's SSE body to the client, accounting every chunk in `exchange`; `settle`,
    when given, runs before the closing write (its time is not counted as relay time).

    Events that arrive in one read from the backend leave in one write to the client: a fast backend
    costs one send per read, not one per token. `collect`, when given, receives every chunk object as
    the backend sent it (usage included), for the cache to assemble the whole answer.

    Once one chunk has been parsed (it sets the model served), the plain token chunks of a
    one-choice stream are forwarded as they came and counted without parsing (`quick_tokens`); the
    usage, finish and error chunks are parsed, as is every chunk when `collect` is given. A read that
    is exactly one such event (the usual read of a paced stream) skips the decoder too and leaves as
    the bytes it came in (`single_quick_event`): no split, strip, re-framing or join per token."""
    wants_usage = exchange.inbound.client_wants_usage
    quick = collect is None and exchange.inbound.choices == 1
    parsed_one = False
    timer = exchange.timer
    decoder = SSEDecoder()
    saw_done = False
    pending = b""
    held_at = 0  # when the read whose events leave with the closing write came in
    try:
        async for chunk in chunks:
            if saw_done:
                continue  # read the body to its end so the pooled connection is reused
            timer.last_in = read_at = now_ns()
            if parsed_one and decoder.idle and (n := single_quick_event(chunk)) is not None:
                # the common read mid-stream: one whole plain token event, relayed as the bytes it came in
                if n:
                    exchange.count_token()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                timer.relayed(read_at)
                if client_gone():
                    break
                continue
            out: list[bytes] = []
            for data in decoder.feed(chunk):
                if data == DONE:
                    saw_done = True
                    break
                if parsed_one:
                    n = quick_tokens(data)
                    if n is not None:
                        if n:
                            exchange.count_token()
                        out.append(encode_event(data))
                        continue
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue  # comments, keep-alives or garbage: nothing to account or relay
                if not isinstance(obj, dict):
                    continue
                parsed_one = quick
                if "error" in obj and not obj.get("choices"):
                    exchange.fail("upstream_error", 502, "upstream_error")
                    out.append(encode_event(data))
                    saw_done = True  # the backend's own error closes the stream
                    break
                exchange.observe(obj)
                if collect is not None:
                    collect.append(obj)
                if obj.get("usage") and not wants_usage:
                    if not obj.get("choices"):
                        continue  # the usage-only chunk the gateway asked for on its own account
                    obj = {k: v for k, v in obj.items() if k != "usage"}
                    data = orjson.dumps(obj)
                out.append(encode_event(data))
            if saw_done:
                held_at = read_at
            if out:
                if saw_done:
                    pending = b"".join(out)  # leaves with the closing events, in one write
                else:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    timer.relayed(read_at)
            if client_gone():
                break
    except (UpstreamBroken, aiohttp.ClientError, OSError, TimeoutError):
        if not client_gone():
            exchange.fail("upstream_error", 502, "upstream_error")
            await send(
                {"type": "http.response.body", "body": error_event(stream_broken()), "more_body": True}
            )
            saw_done = True
    if client_gone():
        exchange.fail("client_disconnected", 499, "client_disconnected")
        return
    tail = pending
    if exchange.stopped_by_budget:
        exchange.fail("budget_exhausted", 200, "budget_exhausted")
        tail += error_event(budget_exhausted(exchange.max_tokens_sent))
    elif not saw_done and exchange.finish_reason is None:
        exchange.fail("upstream_error", 502, "upstream_error")
        tail += error_event(stream_broken())
    tail += encode_event(DONE)
    if settle is not None:
        settle_from = now_ns()
        await settle()
        if held_at:
            held_at += now_ns() - settle_from
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    timer.finished(held_at)


async def gather(chunks: AsyncIterator[bytes], exchange: Exchange) -> list[dict[str, Any]]:
    """Read a backend's SSE body to its end for a client that wants one whole answer, accounting
    every chunk in `exchange` as it comes (so a client that leaves is billed what was produced) and
    sending nothing. A backend's error event or a stream cut before its end raises the client's
    error; the answer is then not billed, since the client receives none of it."""
    collected: list[dict[str, Any]] = []
    saw_done = False
    try:
        async for data in iter_data(chunks):
            if saw_done:
                continue  # read the body to its end so the pooled connection is reused
            if data == DONE:
                saw_done = True
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue  # comments and keep-alives
            if not isinstance(obj, dict):
                continue
            if "error" in obj and not obj.get("choices"):
                err = obj["error"] if isinstance(obj["error"], dict) else {}
                _unbill(exchange)
                raise StreamCut(
                    502,
                    f"The backend failed mid-answer: {err.get('message') or 'no reason given'}. "
                    "Retry the request.",
                    type="api_error",
                    code="upstream_error",
                )
            exchange.observe(obj)
            collected.append(obj)
    except (UpstreamBroken, aiohttp.ClientError, OSError, TimeoutError):
        _unbill(exchange)
        raise stream_broken() from None
    if not saw_done and exchange.finish_reason is None:
        _unbill(exchange)
        raise stream_broken()
    return collected


def _unbill(exchange: Exchange) -> None:
    exchange.usage = None
    exchange.content_chunks = 0


def encode_chunks(objs: list[dict[str, Any]]) -> bytes:
    """Chunk objects as one SSE body ending in `[DONE]` (a cached answer replayed to a streaming client)."""
    return b"".join(encode_event(orjson.dumps(o)) for o in objs) + encode_event(DONE)
