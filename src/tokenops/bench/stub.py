"""A fast OpenAI-compatible stub upstream that streams N tokens at a set pace.

It stands for an infinitely fast (or exactly paced) provider: the gateway's overhead, the bench's
own accuracy and fault handling are measured against it. It owns nothing but its own pacing and
fault knobs; it does not tokenize, sample or load a model.

Stable API (other packages' tests use it; keep it backward compatible):

- ``StubConfig``: the knobs, a mutable dataclass; the running app reads it on every request, so a
  test may change e.g. ``fail_status`` on a live server.
    - ``models``: names listed by ``/v1/models``; any model name is accepted unless ``strict_models``.
    - ``output_tokens``: tokens per answer when the request gives no ``max_tokens``
      (``max_tokens``/``max_completion_tokens`` override it: the answer has exactly that many).
    - ``ttft_s``: delay before the first token; ``itl_s``: delay between tokens.
    - ``load_itl_s``: extra delay between tokens per request in flight, so that latency grows with
      load as an engine's does (for sweeps and balancing tests); 0 keeps the pace fixed.
    - ``fail_status``: answer with this HTTP status (OpenAI error body) instead of a completion;
      ``fail_count``: only the next that many requests fail (``None``: all of them).
    - ``drop_after``: close the connection abruptly after this many streamed tokens (mid-stream
      drop); a non-streaming request gets its status line and headers, then the connection closes.
    - ``reply``: the answer's text (its whitespace-separated words are the tokens; ``max_tokens``
      cuts it short with ``finish_reason="length"``); ``None`` answers filler words.
    - ``replies``: texts answered one per request, in order, before falling back to ``reply`` (each
      request takes the first; a test scripts disagreeing samples with it). A non-streamed request
      with ``n`` > 1 answers n choices, each taking the next text; usage counts the prompt once.
    - ``logprob``: every token's log-probability, returned (non-streamed answers only) when the
      request asks for ``logprobs`` — a cascade's confidence check reads it.
    - ``prefix_cache``: report ``prompt_tokens_details.cached_tokens`` as the length of the longest
      prefix of whole ``block_size``-word blocks seen in earlier prompts (a small LRU of block hashes),
      so prefix-aware balancing shows real hits.
- Per-request overrides by header: ``x-stub-ttft-ms``, ``x-stub-itl-ms``, ``x-stub-tokens``,
  ``x-stub-fail-status``, ``x-stub-drop-after``.
- A streamed answer carries ``x-stub-timing: received=<ns>,ready=<ns>``: ``time.perf_counter_ns()``
  when the handler was called and when its stream was ready to start (CLOCK_MONOTONIC on Linux, so
  a client on the same host reads them on its own clock: the gateway benchmark does).
- ``create_stub_app(config=None, **knobs) -> Starlette``: routes ``POST /v1/chat/completions``,
  ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /stub/stats``
  (``{"requests", "in_flight", "failed", "dropped", "with_session"}``). ``app.state.config`` and
  ``app.state.stats`` hold the live config and counters.
- ``run_stub_in_thread(config=None, **knobs) -> (url, stop)``: serves the app on a free loopback port
  in a daemon thread; ``url`` is like ``http://127.0.0.1:PORT`` (append ``/v1`` for the OpenAI SDK);
  ``stop()`` shuts it down and joins the thread.
- ``tokenops bench stub --port 8001 --tokens 64 --ttft-ms 20 --itl-ms 5``.

Token counting: a prompt token is a whitespace-separated word of the prompt (chat: of all messages'
text), and each streamed chunk carries exactly one output token, so counts are exact and cheap.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tokenops.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    from_validation_error,
    invalid_request,
    model_not_found,
    new_id,
    now,
)

# Short common English words: one token each in the usual BPE vocabularies.
_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "at", "by")


@dataclass
class StubConfig:
    models: list[str] = field(default_factory=lambda: ["stub"])
    strict_models: bool = False
    output_tokens: int = 16
    ttft_s: float = 0.0
    itl_s: float = 0.0
    load_itl_s: float = 0.0
    reply: str | None = None
    replies: list[str] = field(default_factory=list)
    logprob: float = -0.05
    fail_status: int | None = None
    fail_count: int | None = None
    drop_after: int | None = None
    prefix_cache: bool = True
    block_size: int = 16
    cache_blocks: int = 100_000

    def __post_init__(self) -> None:
        if any(not r.split() for r in [*([self.reply] if self.reply is not None else []), *self.replies]):
            raise ValueError("reply must hold at least one word")
        if self.output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        if self.ttft_s < 0 or self.itl_s < 0:
            raise ValueError("delays must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")


@dataclass
class StubStats:
    requests: int = 0
    in_flight: int = 0
    failed: int = 0
    dropped: int = 0
    with_session: int = 0  # requests that carried an x-session-id header
    # the thinking asked for by the latest request (a route's reasoning decision is checked here)
    last_reasoning_effort: str | None = None
    last_max_reasoning_tokens: int | None = None


class _StubDrop(Exception):
    """Raised inside a response body to make the server cut the connection mid-stream."""


class _BlockCache:
    """LRU set of chained block hashes: the stub's stand-in for an engine's prefix cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def cached_prefix(self, words: list[str], block_size: int) -> int:
        """Return the cached prefix length in words, then insert this prompt's blocks."""
        h = b""
        hit = 0
        missed = False
        for start in range(0, len(words) - block_size + 1, block_size):
            h = hashlib.blake2b(
                h + " ".join(words[start : start + block_size]).encode(), digest_size=16
            ).digest()
            if not missed and h in self._blocks:
                self._blocks.move_to_end(h)
                hit += block_size
                continue
            missed = True
            self._blocks[h] = None
            if len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return hit


class _StreamFrame:
    """One answer's SSE events, pre-rendered around the token text: two concatenations per token keep
    the stub cheap. (The model name is the client's string, so no %-formatting on these templates.)"""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        finish: str,
        reply: list[str] | None,
        usage: dict[str, Any] | None,
    ) -> None:
        head = orjson.dumps(
            {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now(),
                "model": model,
            }
        )[:-1]
        if chat:
            self.first = (
                b"data: " + head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"finish_reason":null}]}\n\n'
            )
            self.pre = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":"'
            self.post = b'"},"finish_reason":null}]}\n\n'
            last = head + b',"choices":[{"index":0,"delta":{},"finish_reason":"' + finish.encode() + b'"}]}'
        else:
            self.first = b""
            self.pre = b"data: " + head + b',"choices":[{"index":0,"text":"'
            self.post = b'","logprobs":null,"finish_reason":null}]}\n\n'
            last = (
                head
                + b',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"'
                + finish.encode()
                + b'"}]}'
            )
        # JSON-escaped token text (a reply may hold quotes or backslashes)
        self.words = [orjson.dumps(w + " ")[1:-1] for w in (reply or _WORDS)]
        tail = [b"data: " + last + b"\n\n"]
        if usage is not None:
            tail.append(b"data: " + head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        tail.append(b"data: [DONE]\n\n")
        self.tail = b"".join(tail)

    def token(self, i: int) -> bytes:
        return self.pre + self.words[i % len(self.words)] + self.post

    def whole(self, n: int) -> bytes:
        return b"".join([self.first, *(self.token(i) for i in range(n)), self.tail])


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _error(exc: APIError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


def _header_num(request: Request, name: str, cast: Callable[[str], Any]) -> Any:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        return cast(raw)
    except ValueError:
        raise invalid_request(f"Header {name} must be a number, got {raw!r}.", param=name) from None


def _prompt_words(req: ChatCompletionRequest | CompletionRequest) -> list[str]:
    if isinstance(req, ChatCompletionRequest):
        return " ".join(m.text() for m in req.messages).split()
    p = req.prompt
    if isinstance(p, str):
        return p.split()
    if p and isinstance(p[0], str):
        return " ".join(p).split()  # type: ignore[arg-type]
    if p and isinstance(p[0], list):
        return [str(t) for seq in p for t in seq]  # type: ignore[union-attr]
    return [str(t) for t in p]


def create_stub_app(config: StubConfig | None = None, **knobs: Any) -> Starlette:
    """Build the stub's Starlette app. Pass a `StubConfig` or its fields as keywords."""
    cfg = config if config is not None else StubConfig(**knobs)
    stats = StubStats()
    cache = _BlockCache(cfg.cache_blocks)

    async def health(_: Request) -> Response:
        return _json({"status": "ok"})

    async def models(_: Request) -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "tokenops-stub"} for m in cfg.models]
        return _json({"object": "list", "data": data})

    async def stub_stats(_: Request) -> Response:
        return _json(stats.__dict__)

    async def chat(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, *, chat: bool) -> Response:
        received = time.perf_counter_ns()
        stats.requests += 1
        stats.with_session += "x-session-id" in request.headers
        try:
            try:
                raw = orjson.loads(await request.body())
            except orjson.JSONDecodeError:
                raise invalid_request("The request body is not valid JSON.", code="invalid_json") from None
            if not isinstance(raw, dict):
                raise invalid_request("The request body must be a JSON object.")
            try:
                req = (
                    ChatCompletionRequest.model_validate(raw)
                    if chat
                    else CompletionRequest.model_validate(raw)
                )
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            if cfg.strict_models and req.model not in cfg.models:
                raise model_not_found(req.model, cfg.models)
            stats.last_reasoning_effort = getattr(req, "reasoning_effort", None)
            stats.last_max_reasoning_tokens = getattr(req, "max_reasoning_tokens", None)
            fail = _header_num(request, "x-stub-fail-status", int)
            if (
                fail is None
                and cfg.fail_status is not None
                and (cfg.fail_count is None or cfg.fail_count > 0)
            ):
                fail = cfg.fail_status
                if cfg.fail_count is not None:
                    cfg.fail_count -= 1
            if fail is not None:
                stats.failed += 1
                headers = {"retry-after": "1"} if fail == 429 else None
                raise APIError(
                    fail,
                    f"Stub failure injected (status {fail}).",
                    type="stub_error",
                    code="stub_failure",
                    headers=headers,
                )
            n = _header_num(request, "x-stub-tokens", int)
            text = cfg.replies.pop(0) if cfg.replies else cfg.reply
            reply = text.split() if text is not None else None
            if n is None and reply is not None:
                n = len(reply) if req.max_tokens is None else min(len(reply), req.max_tokens)
            if n is None:
                n = req.max_tokens if req.max_tokens is not None else cfg.output_tokens
            if n < 0:
                raise invalid_request("x-stub-tokens must be >= 0.", param="x-stub-tokens")
            ttft_ms = _header_num(request, "x-stub-ttft-ms", float)
            itl_ms = _header_num(request, "x-stub-itl-ms", float)
            drop = _header_num(request, "x-stub-drop-after", int)
        except APIError as exc:
            return _error(exc)
        ttft = cfg.ttft_s if ttft_ms is None else ttft_ms / 1000
        itl = cfg.itl_s if itl_ms is None else itl_ms / 1000
        drop = cfg.drop_after if drop is None else drop
        words = _prompt_words(req)
        cached = cache.cached_prefix(words, cfg.block_size) if cfg.prefix_cache else 0
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": n,
            "total_tokens": len(words) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
        rid = new_id("chatcmpl" if chat else "cmpl")
        finish = "length" if req.max_tokens is not None and n >= req.max_tokens else "stop"
        if req.stream:
            frame = _StreamFrame(rid, req.model, chat, finish, reply, usage if req.include_usage else None)
            # when the handler was called and when its stream is ready to start: perf_counter_ns is
            # CLOCK_MONOTONIC, so a client on the same host places them on its own timeline
            stamps = f"received={received},ready={time.perf_counter_ns()}"
            headers = {"cache-control": "no-cache", "x-stub-timing": stamps}
            if not (ttft or itl or cfg.load_itl_s or drop is not None):
                # nothing to pace or cut: the whole event stream is known now and leaves as one body
                # (a streaming response's task group per request was most of the stub's CPU)
                return Response(frame.whole(n), media_type="text/event-stream", headers=headers)
            return StreamingResponse(
                _stream(frame, n, ttft, itl, drop), media_type="text/event-stream", headers=headers
            )
        if drop is not None:
            stats.dropped += 1
            return StreamingResponse(_dropped(), media_type="application/json")
        stats.in_flight += 1
        try:
            await asyncio.sleep(ttft + (itl + cfg.load_itl_s * stats.in_flight) * max(n - 1, 0))
        finally:
            stats.in_flight -= 1

        def one(index: int, reply: list[str] | None, n: int) -> dict[str, Any]:
            finish = "length" if req.max_tokens is not None and n >= req.max_tokens else "stop"
            tokens = [f"{(reply or _WORDS)[i % len(reply or _WORDS)]} " for i in range(n)]
            text = "".join(tokens)
            wants_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
            if chat:
                logprobs = (
                    {
                        "content": [
                            {"token": t, "logprob": cfg.logprob, "bytes": None, "top_logprobs": []}
                            for t in tokens
                        ]
                    }
                    if wants_logprobs
                    else None
                )
                return {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            logprobs = (
                {
                    "tokens": tokens,
                    "token_logprobs": [cfg.logprob] * n,
                    "top_logprobs": None,
                    "text_offset": None,
                }
                if wants_logprobs
                else None
            )
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        choices = [one(0, reply, n)]
        for index in range(1, req.n):  # more choices of the same prompt: its prefill is shared
            more = (cfg.replies.pop(0) if cfg.replies else cfg.reply or "").split() or None
            k = len(more) if more is not None else (req.max_tokens or cfg.output_tokens)
            k = min(k, req.max_tokens) if req.max_tokens is not None else k
            choices.append(one(index, more, k))
            usage["completion_tokens"] += k
            usage["total_tokens"] += k
        return _json(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": now(),
                "model": req.model,
                "choices": choices,
                "usage": usage,
            }
        )

    async def _dropped() -> AsyncIterator[bytes]:
        # the status line and headers are out; the connection closes before any body byte
        raise _StubDrop("non-streaming request dropped")
        yield b""  # pragma: no cover (makes this an async generator)

    async def _stream(
        frame: _StreamFrame, n: int, ttft: float, itl: float, drop: int | None
    ) -> AsyncIterator[bytes]:
        stats.in_flight += 1
        try:
            if frame.first:
                yield frame.first
            if ttft:
                await asyncio.sleep(ttft)
            # tokens are due on a clock, as an engine's decode steps are, so the pace does not drift
            # with how long each write took (a proxy in front must not look slower than it is)
            loop = asyncio.get_running_loop()
            due = loop.time()
            batch: list[bytes] = []
            for i in range(n):
                if drop is not None and i >= drop:
                    stats.dropped += 1
                    if batch:
                        yield b"".join(batch)
                    raise _StubDrop(f"stream dropped after {i} tokens")
                chunk = frame.token(i)
                pace = itl + cfg.load_itl_s * stats.in_flight
                if pace and i > 0:
                    due += pace
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    yield chunk
                elif pace or i == 0:
                    yield chunk
                else:
                    batch.append(chunk)  # no pace: send the rest of the answer in one write
            if batch:
                yield b"".join(batch)
            yield frame.tail
        finally:
            stats.in_flight -= 1

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/stub/stats", stub_stats, methods=["GET"]),
        ]
    )
    app.state.config = cfg
    app.state.stats = stats
    return app


def run_stub_in_thread(config: StubConfig | None = None, **knobs: Any) -> tuple[str, Callable[[], None]]:
    """Serve a stub on a free loopback port in a daemon thread; return (base url, stop)."""
    import uvicorn

    app = create_stub_app(config, **knobs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="critical", access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"stub-{port}")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("stub server did not start")
        time.sleep(0.005)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


def serve_stub(host: str = "127.0.0.1", port: int = 8001, config: StubConfig | None = None) -> None:
    """Run the stub in the foreground (the `tokenops bench stub` command)."""
    import uvicorn

    uvicorn.run(create_stub_app(config), host=host, port=port, log_level="warning", access_log=False)
