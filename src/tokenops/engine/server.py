"""The OpenAI-compatible HTTP server in front of one engine: `/v1/chat/completions` and
`/v1/completions` (streaming SSE and not, `n`, logprobs, stop strings, usage with cached prompt
tokens), `/v1/models`, `/health`, `/metrics`, `/v1/load` and `/v1/kv_events`. It turns a request into
prompt token ids and `SamplingParams`, rejects what a caller can get wrong with an OpenAI-format 4xx
before the engine sees it (`tokenops.protocol`), submits to the `AsyncEngine`, and streams or returns
what `generation.Generation` renders (streamed deltas concatenate exactly to the non-streamed text;
thinking models get `reasoning_content` and a thinking budget). A client that disconnects has its
request aborted at once. It does not schedule, sample or stop on token ids (the engine does), it
hands a request's prefill/decode leg to `kv_legs`, and it holds no tenant or billing logic (the
gateway does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tokenops.engine import kv_transfer_params
from tokenops.engine.async_engine import AsyncEngine, EngineError
from tokenops.engine.config import RequestRejected
from tokenops.engine.detokenizer import OutputText
from tokenops.engine.generation import Choice, Generation
from tokenops.engine.grammar import CompiledGrammar, GrammarCompiler
from tokenops.engine.kv_legs import KVLegs
from tokenops.engine.kv_transfer_params import DecodeLeg, PrefillLeg
from tokenops.engine.metrics import CONTENT_TYPE, EngineMetrics, TransferCollector
from tokenops.engine.reasoning import (
    DEFAULT_EFFORT_BUDGETS,
    Phase,
    ReasoningMarkers,
    ReasoningParser,
    ReasoningSpec,
    generation_suffix,
    prompt_phase,
    resolve_budget,
)
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.tool_output import ToolOutput
from tokenops.engine.tool_parsers import PARSERS, parser_for
from tokenops.modelfiles.openmp import release_thread_pool
from tokenops.modelfiles.tokenizer import template_messages
from tokenops.modelfiles.tool_prompt import prompt_messages
from tokenops.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    context_length_exceeded,
    from_validation_error,
    invalid_request,
    model_not_found,
    new_id,
    now,
)
from tokenops.structured_output import OutputSpec, output_spec

log = logging.getLogger(__name__)

MAX_CHOICES = 64  # prompts x n in one request
MAX_KV_EVENTS_PER_POLL = 1000


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    max_model_len: int  # context window: prompt + completion tokens
    model_path: str = ""
    # default for max_tokens when a request gives none: the rest of the context window if None
    default_max_tokens: int | None = None
    # the model's thinking markers (None: it does not think): answers are split into
    # reasoning_content and content, and max_reasoning_tokens / reasoning_effort are enforced
    reasoning_markers: ReasoningMarkers | None = None
    reasoning_effort_budgets: dict[str, int | None] = field(
        default_factory=lambda: dict(DEFAULT_EFFORT_BUDGETS)
    )
    # prefill/decode disaggregation: "prefill" takes no decode legs, "decode" no prefill legs, "both" all
    role: str = "both"
    engine_id: str = ""  # this engine's name in kv_transfer_params (a random one if empty)
    kv_transfer_host: str = "127.0.0.1"  # where the KV transfer server listens (port 0: any free port)
    kv_transfer_port: int = 0
    kv_pull_timeout_s: float = 30.0
    # how tool calls are read from the text (a name in tool_parsers.PARSERS); None: from the template
    tool_parser: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(
                f"tool_parser must be one of {', '.join(sorted(PARSERS))}, got {self.tool_parser!r}"
            )


@dataclass
class _Reasoning:
    """A request's thinking: where generation starts and its budget (None: unlimited)."""

    phase: Phase
    budget: int | None


# ---------------------------------------------------------------------------------------------
# The SSE response: streams and watches for the client's disconnect at the same time


class _SSEResponse(StreamingResponse):
    """Streams SSE while listening for `http.disconnect`; runs `on_close` however it ends.

    Starlette's own StreamingResponse notices a gone client only at its next write (ASGI 2.4); a
    request still waiting for its first token would keep its KV blocks until then.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------
# The server


class EngineServer:
    """Routes and request handling; `app` is the Starlette application."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = EngineMetrics(config.served_model_names[0], lambda: self.engine.load)
        self._token_text: dict[int, str] = {}
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._vocab_size = int(getattr(tokenizer, "vocab_size", 0) or 0)
        self.tool_parser = parser_for(getattr(tokenizer, "chat_template", None), config.tool_parser)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self.kv: KVLegs | None = None  # prefill/decode legs, where the engine can transfer its KV
        inner = getattr(engine, "engine", None)
        if getattr(inner, "kv_layout", None) is not None:
            self.kv = KVLegs(
                engine,
                engine_id=config.engine_id or new_id("engine"),
                host=config.kv_transfer_host,
                port=config.kv_transfer_port,
                pull_timeout_s=config.kv_pull_timeout_s,
            )
            self.metrics.registry.register(
                TransferCollector(inner.transfer_stats, config.served_model_names[0])
            )
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/load", self.load, methods=["GET"]),
                Route("/v1/kv_events", self.kv_events, methods=["GET"]),
            ],
            exception_handlers={
                APIError: self._on_api_error,
                HTTPException: self._on_http_error,
                Exception: self._on_crash,
            },
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start(asyncio.get_running_loop())
        if self.kv is not None:
            await self.kv.start()
        try:
            yield
        finally:
            if self.kv is not None:
                await self.kv.close()
            await asyncio.to_thread(self.engine.shutdown)

    # -- errors -----------------------------------------------------------------------------------

    async def _on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = exc.detail if exc.status_code != 404 else f"No route {request.method} {request.url.path}."
        return error_response(APIError(exc.status_code, str(msg), type=kind))

    async def _on_crash(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(APIError(500, f"Internal error: {type(exc).__name__}.", type="server_error"))

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (cached: the same ids come back all the time)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 500_000:
                self._token_text[token_id] = text
        return text

    # -- small endpoints ----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "tokenops",
                "root": self.config.model_path or name,
                "max_model_len": self.config.max_model_len,
            }
            for name in self.config.served_model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            return JSONResponse(
                {"status": "error", "detail": "engine thread is not running"}, status_code=503
            )
        return JSONResponse({"status": "ok", "last_error": self.engine.last_error})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def load(self, request: Request) -> Response:
        body = self.engine.load.to_json()
        body["role"] = self.config.role
        inner = getattr(self.engine, "engine", None)
        pool = getattr(inner, "pool", None)
        if pool is not None:
            body["block_size"] = pool.block_size
        scheduler = getattr(inner, "scheduler", None)
        if scheduler is not None:
            # the step limits as this engine resolved them (the prefill step depends on the CPU), so a
            # simulator replaying it, or a planner sizing a fleet of it, models the engine that runs
            c = scheduler.config
            body["scheduler"] = {
                "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens,
                "max_chunk_tokens": c.max_chunk_tokens,
                "max_prefill_step_tokens": c.max_prefill_step_tokens,
            }
        if self.kv is not None:
            body["kv_transfer"] = self.kv.address()
        return JSONResponse(body)

    async def kv_events(self, request: Request) -> Response:
        try:
            since = int(request.query_params.get("since", "0"))
            limit = int(request.query_params.get("limit", str(MAX_KV_EVENTS_PER_POLL)))
        except ValueError:
            raise invalid_request("'since' and 'limit' must be integers.", param="since") from None
        events, oldest = self.engine.kv_events.since(since, max(1, min(limit, MAX_KV_EVENTS_PER_POLL)))
        next_seq = events[-1]["seq_no"] + 1 if events else since
        # `missed` tells a poller that fell behind that it must resynchronise (events were dropped)
        return JSONResponse({"events": events, "next": next_seq, "missed": since < oldest})

    # -- completions --------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        async with self._refusal_releases_hold(request):
            return await self._chat_completions(request)

    async def completions(self, request: Request) -> Response:
        async with self._refusal_releases_hold(request):
            return await self._completions(request)

    @contextlib.asynccontextmanager
    async def _refusal_releases_hold(self, request: Request) -> AsyncIterator[None]:
        """A decode leg refused here for its input (a 4xx but 429) will not pull its prefill
        engine's hold: say so, as when it prefills itself, rather than leave it until its timeout.
        A refusal another engine may not give (429, 5xx) leaves the hold to a retry elsewhere."""
        try:
            yield
        except APIError as exc:
            if self.kv is not None and 400 <= exc.status < 500 and exc.status != 429:
                with contextlib.suppress(APIError, orjson.JSONDecodeError):
                    body = orjson.loads(await request.body())
                    if isinstance(body, dict):
                        self.kv.release(kv_transfer_params.parse(body.get(kv_transfer_params.PARAM)))
            raise

    async def _chat_completions(self, request: Request) -> Response:
        req = _parse(ChatCompletionRequest, await self._json(request))
        self._check_common(req)
        spec = output_spec(req.tools, req.tool_choice, req.response_format, req.parallel_tool_calls)
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise invalid_request(
                f"The model '{req.model}' has no chat template, so it cannot answer chat requests. "
                "Use /v1/completions with a plain prompt instead.",
                param="messages",
                code="chat_template_missing",
            )
        template = getattr(self.tokenizer, "chat_template", None)
        messages = prompt_messages(template, template_messages(req.messages), req.tools)
        variables = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(variables) & {"messages", "add_generation_prompt", "tools"})
        if reserved:
            raise invalid_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own fields.",
                param="chat_template_kwargs",
            )
        markers = self.config.reasoning_markers
        budget = self._reasoning_budget(req) if markers is not None else None
        if budget == 0:
            # no thinking: templates that know the switch (Qwen3) prefill an empty thinking section
            variables.setdefault("enable_thinking", False)
        reasoning = None
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=req.tools, **variables
            )
            if markers is not None:
                # the generation prompt alone says whether it opens (R1) or closes (Qwen3, no thinking)
                # a section
                bare = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=False, tools=req.tools, **variables
                )
                reasoning = _Reasoning(prompt_phase(generation_suffix(prompt, bare), markers), budget)
        except Exception as exc:  # noqa: BLE001 - templates raise their own errors for bad conversations
            raise invalid_request(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        logprobs_k = (req.top_logprobs or 0) if req.logprobs else None
        grammar = await self._compile(spec) if spec.grammar is not None else None
        return await self._generate(
            request,
            "chat",
            req,
            [ids],
            logprobs_k,
            echo=[""],
            reasoning=[reasoning],
            spec=spec,
            grammar=grammar,
        )

    async def _compile(self, spec: OutputSpec) -> CompiledGrammar:
        """The request's grammar against this model's tokenizer (off the event loop: building the
        tokenizer's view takes about a second, a large schema some milliseconds)."""
        if self._grammars is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise invalid_request(
                    "This engine's tokenizer cannot constrain output.", param="response_format"
                )
            vocab = self.engine.engine.model_config.vocab_size
            eos = sorted(self._eos)
            self._grammars = await asyncio.to_thread(GrammarCompiler, backend.to_str(), vocab, eos)
        try:
            return await asyncio.to_thread(self._grammars.compile, spec.grammar)
        except RequestRejected as exc:
            param = "tool_choice" if spec.forced_call else exc.param
            raise APIError(400, exc.message, code=exc.code, param=param) from None

    async def _completions(self, request: Request) -> Response:
        req = _parse(CompletionRequest, await self._json(request))
        self._check_common(req)
        if req.suffix:
            raise invalid_request("suffix is not supported by this engine.", param="suffix")
        if req.echo and req.logprobs is not None:
            raise invalid_request(
                "echo together with logprobs needs prompt logprobs, which this engine does not compute. "
                "Drop one of them.",
                param="echo",
            )
        prompts = _prompt_list(req.prompt)
        markers = self.config.reasoning_markers
        budget = self._reasoning_budget(req) if markers is not None else None
        ids_list: list[list[int]] = []
        echo: list[str] = []
        reasoning: list[_Reasoning | None] = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=True)
                echo.append(p if req.echo else "")
            else:
                if self._vocab_size and any(t < 0 or t >= self._vocab_size for t in p):
                    raise invalid_request(
                        f"Token ids in the prompt must be in [0, {self._vocab_size}).", param="prompt"
                    )
                ids = list(p)
                echo.append(self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
            ids_list.append(ids)
            if markers is not None:
                # a plain prompt is the model's own text: its last marker says where generation starts
                text = (
                    p if isinstance(p, str) else self.tokenizer.decode(ids[-64:], skip_special_tokens=False)
                )
                reasoning.append(_Reasoning(prompt_phase(text, markers), budget))
            else:
                reasoning.append(None)
        return await self._generate(
            request, "completion", req, ids_list, req.logprobs, echo=echo, reasoning=reasoning
        )

    # -- shared request path ----------------------------------------------------------------------------

    async def _json(self, request: Request) -> Any:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid_request(
                f"The request body is not valid JSON: {exc}.", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise invalid_request("The request body must be a JSON object.", code="invalid_json")
        return body

    def _check_common(self, req: SamplingFields) -> None:
        if req.model not in self.config.served_model_names:
            raise model_not_found(req.model, self.config.served_model_names)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise invalid_request(
                    f"{name} is not supported by this engine; omit it or send 0.", param=name
                )
        extra = req.model_extra or {}
        if extra.get("logit_bias"):
            raise invalid_request("logit_bias is not supported by this engine.", param="logit_bias")
        if (extra.get("best_of") or 1) != 1:
            raise invalid_request("best_of is not supported by this engine; use n.", param="best_of")
        if (
            req.stop_token_ids
            and self._vocab_size
            and any(t < 0 or t >= self._vocab_size for t in req.stop_token_ids)
        ):
            raise invalid_request(
                f"stop_token_ids must be in [0, {self._vocab_size}).", param="stop_token_ids"
            )

    def _reasoning_budget(self, req: SamplingFields) -> int | None:
        try:
            return resolve_budget(
                req.max_reasoning_tokens, req.reasoning_effort, self.config.reasoning_effort_budgets
            )
        except RequestRejected as exc:
            raise APIError(400, exc.message, code=exc.code, param=exc.param) from None

    def _priority(self, req: SamplingFields, request: Request) -> int:
        value = (req.model_extra or {}).get("priority")
        param = "priority"
        if value is None and request.headers.get("x-priority") is not None:
            value, param = request.headers["x-priority"], "x-priority"
        if value is None:
            return 0
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise invalid_request(
                f"{param} must be an integer (lower is more important), got {value!r}.", param=param
            ) from None

    def _params(
        self,
        req: SamplingFields,
        prompt_len: int,
        logprobs_k: int | None,
        seed_offset: int,
        reasoning: _Reasoning | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> SamplingParams:
        window = self.config.max_model_len
        if prompt_len == 0:
            raise invalid_request("The prompt is empty.", param="prompt")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = window - prompt_len
            if self.config.default_max_tokens is not None:
                max_tokens = min(max_tokens, self.config.default_max_tokens)
        if prompt_len >= window or prompt_len + max_tokens > window:
            raise context_length_exceeded(prompt_len, req.max_tokens, window)
        markers = self.config.reasoning_markers
        if grammar is not None and reasoning is not None and markers is not None:
            grammar = grammar.after_thinking(markers, reasoning.phase)  # the thinking stays free
        speculative = (req.model_extra or {}).get("speculative", True)
        if not isinstance(speculative, bool):
            raise invalid_request(
                f"speculative must be true or false (false opts this request out of speculative decoding), "
                f"got {speculative!r}.",
                param="speculative",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=None if req.seed is None else req.seed + seed_offset,
                stop_token_ids=list(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs_k,
                reasoning=(
                    ReasoningSpec(markers, reasoning.phase, reasoning.budget)
                    if reasoning is not None and reasoning.budget is not None and markers
                    else None
                ),
                speculative=speculative,
                grammar=grammar,
            )
        except RequestRejected as exc:
            raise APIError(400, exc.message, code=exc.code, param=exc.param) from None

    async def _generate(
        self,
        request: Request,
        kind: str,
        req: SamplingFields,
        prompts: list[list[int]],
        logprobs_k: int | None,
        echo: list[str],
        reasoning: list[_Reasoning | None],
        spec: OutputSpec | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Response:
        if len(prompts) * req.n > MAX_CHOICES:
            raise invalid_request(
                f"At most {MAX_CHOICES} choices (prompts x n) per request; "
                f"this one asks for {len(prompts) * req.n}.",
                param="n",
            )
        priority = self._priority(req, request)
        stops = req.stop or []  # validated into a list by SamplingFields
        plans = []
        for p_idx, ids in enumerate(prompts):
            for j in range(req.n):
                params = self._params(req, len(ids), logprobs_k, j, reasoning[p_idx], grammar)
                plans.append((p_idx, j, ids, params))
        gen = Generation(self, kind, req, [], logprobs_k)
        markers = self.config.reasoning_markers
        for index, (p_idx, j, ids, params) in enumerate(plans):
            stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
            thinking = reasoning[p_idx]
            gen.choices.append(
                Choice(
                    index=index,
                    request_id=f"{gen.id}-{index}",
                    prompt_ids=ids,
                    text=OutputText(self.tokenizer, ids, stop=stops),
                    stop_ids=stop_ids,
                    counts_prompt=(j == 0),
                    echo=echo[p_idx],
                    reasoning=ReasoningParser(markers, thinking.phase) if markers and thinking else None,
                    # stop strings apply to the answer, not to the thinking
                    reasoning_text=OutputText(self.tokenizer, ids)
                    if markers and thinking and kind == "chat"
                    else None,
                    reasoning_budget=thinking.budget if thinking else None,
                    tools=self._tool_output(req, spec),
                )
            )
        gen.by_request = {c.request_id: c for c in gen.choices}
        leg = self._kv_leg(req, plans)
        hold_kv, kv_import = False, None
        if leg is not None:
            assert self.kv is not None  # `_kv_leg` refuses a leg otherwise
            hold_kv = isinstance(leg, PrefillLeg)
            kv_import = await self.kv.pull_for(leg, plans[0][2], gen)
        try:
            for c, (_, _, ids, params) in zip(gen.choices, plans, strict=True):
                self.engine.submit(
                    c.request_id, ids, params, priority, sink=gen.sink, hold_kv=hold_kv, kv_import=kv_import
                )
        except EngineError as exc:
            gen.abort_unfinished()
            raise APIError(
                503, f"The engine is not available: {exc}", type="server_error", code="engine_unavailable"
            ) from None
        if req.stream:
            return await self._stream(request, gen)
        return await self._complete(request, gen)

    def _tool_output(self, req: SamplingFields, spec: OutputSpec | None) -> ToolOutput | None:
        if spec is None or spec.tool_mode == "none":
            return None
        names = {t["function"]["name"] for t in req.tools or ()}
        return ToolOutput(spec.tool_mode, self.tool_parser, names, spec.tool_name)

    async def _race_disconnect(self, request: Request, work: Any) -> Any:
        """Await `work` unless the client disconnects first (then None)."""
        work_task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work_task.done():
                work_task.cancel()
        if work_task in done:
            return work_task.result()
        return None

    async def _complete(self, request: Request, gen: Generation) -> Response:
        async def collect() -> bool:
            while not gen.finished:
                gen.consume(await gen.sink.get())
            return True

        try:
            finished = await self._race_disconnect(request, collect())
        except BaseException:
            gen.abort_unfinished()
            raise
        if not finished:  # the client went away: free its blocks now
            gen.abort_unfinished()
            return Response(status_code=499)
        body = gen.response()
        if gen.kv_fields.get("leg") == "prefill" and self.kv is not None:
            body["kv_transfer_params"] = self.kv.decode_handle(gen.choices[0])
        return JSONResponse(body)

    # -- prefill/decode legs (kv_transfer_params) ---------------------------------------------------

    def _kv_leg(self, req: SamplingFields, plans: list) -> PrefillLeg | DecodeLeg | None:
        leg = kv_transfer_params.parse((req.model_extra or {}).get(kv_transfer_params.PARAM))
        if leg is None:
            return None
        if self.kv is None:
            raise invalid_request("This engine does not transfer KV.", param=kv_transfer_params.PARAM)
        self.kv.check(leg, self.config.role, len(plans), bool(req.stream))
        return leg

    async def _stream(self, request: Request, gen: Generation) -> Response:
        # Wait for the first output before sending headers, so that a request the engine refuses
        # still gets a proper 4xx status rather than an error inside a 200 stream.
        try:
            first = await self._race_disconnect(request, gen.sink.get())
        except BaseException:
            gen.abort_unfinished()
            raise
        if first is None:
            gen.abort_unfinished()
            return Response(status_code=499)
        try:
            first_delta = gen.consume(first)
        except APIError:
            gen.abort_unfinished()
            raise

        async def events() -> AsyncIterator[bytes]:
            offsets: dict[int, int] = {}
            head = []
            for c in gen.choices:
                if gen.kind == "chat":
                    head.append(
                        gen.chunk(
                            [
                                {
                                    "index": c.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                elif c.echo:
                    head.append(
                        gen.chunk(
                            [{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}]
                        )
                    )
            pending = [first_delta]
            try:
                while True:
                    out = head
                    head = []
                    for d in pending:
                        if d is not None and (b := gen.delta_chunk(d, offsets)) is not None:
                            out.append(b)
                    if out:
                        yield b"".join(out)
                    if gen.finished:
                        break
                    # take everything already delivered in one write
                    pending = [gen.consume(await gen.sink.get())]
                    while not gen.sink.empty():
                        pending.append(gen.consume(gen.sink.get_nowait()))
            except APIError as err:
                gen.abort_unfinished()
                yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
            else:
                if gen.req.include_usage:
                    yield gen.chunk([], gen.usage())
            yield b"data: [DONE]\n\n"

        return _SSEResponse(events(), on_close=gen.abort_unfinished)


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def build_app(engine: Any, tokenizer: Any, config: ServerConfig) -> Starlette:
    """The Starlette app serving `engine` (an `LLMEngine`); the engine thread starts with the app."""
    server = EngineServer(AsyncEngine(engine), tokenizer, config)
    app = server.app
    app.state.server = server
    return app


@contextlib.contextmanager
def serve_in_thread(app: Starlette, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` with uvicorn in a background thread (tests, benchmarks); yields its base URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # the engine thread starts on uvicorn's thread, not this one, which loaded the model: give this
    # thread's idle OpenMP pool back here (modelfiles/openmp.py)
    release_thread_pool()
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="tokenops-uvicorn", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
