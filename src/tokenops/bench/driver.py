"""The async HTTP load driver: sends a workload's sessions to an OpenAI-compatible endpoint and records
when every content chunk arrives.

It owns the load shape (fixed concurrency, open-loop arrivals at a rate with an optional concurrency
cap, or a trace's own timestamps), the request/duration bound, warm-up, session ordering (round k+1
of a session is sent only after round k finished and its delay passed, with the real answer of
round k appended to the messages) and the streaming client (aiohttp; SSE parsed from raw network
reads, each chunk time-stamped as it arrives). It does not compute statistics (metrics.py) or render
anything (report.py) beyond a live progress bar.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from tokenops.bench.arrivals import ArrivalProcess
from tokenops.bench.metrics import RequestRecord
from tokenops.bench.traces import MOONCAKE_BLOCK_SIZE, TraceRecord, prompt_corpus
from tokenops.bench.workloads import Session, to_session


@dataclass(slots=True)
class LoadConfig:
    """How to drive the target. With neither `rate` nor `concurrency`, a trace replays on its own
    timestamps (`fixed_schedule`) and a synthetic workload runs at concurrency 1."""

    base_url: str
    model: str = "stub"
    endpoint: str = "chat"  # "chat" or "completions"
    concurrency: int | None = None  # closed loop; with `rate`, the cap on requests in flight
    rate: float | None = None  # sessions started per second (math.inf: all at once)
    burstiness: float = 1.0
    fixed_schedule: bool = False
    time_scale: float = 1.0  # trace timestamps are multiplied by this (0.5 replays twice as fast)
    num_requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    stream: bool = True
    ignore_eos: bool = False  # vLLM/SGLang: generate exactly max_tokens
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    block_size: int = MOONCAKE_BLOCK_SIZE
    progress: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError("endpoint must be 'chat' or 'completions'")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a bound: num_requests or duration_s")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be > 0")
        if self.rate is not None and math.isinf(self.rate) and self.num_requests is None:
            raise ValueError("an infinite rate needs num_requests")

    @property
    def mode(self) -> str:
        if self.rate is not None:
            return "rate"
        if self.fixed_schedule:
            return "schedule"
        return "concurrency"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("api_key")
        d["headers"] = sorted(self.headers)  # names only: values may hold secrets
        d["mode"] = self.mode
        if d["rate"] is not None and math.isinf(d["rate"]):
            d["rate"] = "inf"
        return d


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    started_at: float  # wall-clock epoch seconds of the first measured send
    config: dict[str, Any]  # record times are seconds from the first measured send's clock origin


class _Budget:
    """The run's bound: a request count and/or a deadline for new sends."""

    def __init__(self, n: int | None, deadline: float | None) -> None:
        self.left = n
        self.deadline = deadline

    def exhausted(self) -> bool:
        return (self.left is not None and self.left <= 0) or (
            self.deadline is not None and time.perf_counter() >= self.deadline
        )

    def take(self) -> bool:
        if self.exhausted():
            return False
        if self.left is not None:
            self.left -= 1
        return True


class LoadDriver:
    def __init__(self, cfg: LoadConfig, on_record: Callable[[RequestRecord], None] | None = None) -> None:
        self.cfg = cfg
        self.on_record = on_record
        base = cfg.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.url = base + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")
        self.headers = {"content-type": "application/json", **cfg.headers}
        if cfg.api_key:
            self.headers["authorization"] = f"Bearer {cfg.api_key}"

    # ---------------------------------------------------------------------------------------
    # one request

    def _payload(self, context: list[dict[str, str]], max_tokens: int) -> bytes:
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": max_tokens, "stream": self.cfg.stream}
        if self.cfg.endpoint == "chat":
            body["messages"] = context
        else:
            body["prompt"] = "\n".join(m["content"] for m in context)
        if self.cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.cfg.extra_body)
        return orjson.dumps(body)

    async def send(
        self,
        http: aiohttp.ClientSession,
        context: list[dict[str, str]],
        max_tokens: int,
        session_id: str,
        round_: int,
        multi_round: bool = False,
    ) -> RequestRecord:
        payload = self._payload(context, max_tokens)
        # the gateway's session-aware balancing keys on x-session-id; only real sessions carry one
        headers = {**self.headers, "x-session-id": session_id} if multi_round else self.headers
        start = time.perf_counter()
        rec = RequestRecord(start=start, end=start, session_id=session_id, round=round_)
        parts: list[str] = []
        try:
            async with http.post(self.url, data=payload, headers=headers) as resp:
                if resp.status != 200:
                    body = await resp.text()
                    rec.success = False
                    rec.error = f"HTTP {resp.status}: {_error_message(body)}"
                elif self.cfg.stream:
                    await self._read_stream(resp, rec, parts)
                else:
                    obj = orjson.loads(await resp.read())
                    now = rec.first_byte = time.perf_counter()
                    text = _choice_text(obj, stream=False)
                    if text:
                        rec.chunk_times.append(now)
                        parts.append(text)
                    _take_usage(rec, obj.get("usage"))
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, ValueError) as exc:
            rec.success = False
            rec.error = f"{type(exc).__name__}: {exc}" + (
                f" after {len(rec.chunk_times)} chunks" if rec.chunk_times else ""
            )
        rec.end = time.perf_counter()
        rec.text = "".join(parts)
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, parts: list[str]) -> None:
        buf = b""
        done = False
        async for data in resp.content.iter_any():
            now = time.perf_counter()  # arrival time of this network read, before any parsing
            if rec.first_byte is None:
                rec.first_byte = now
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data_ = line[5:].strip()
                if data_ == b"[DONE]":
                    done = True
                    continue
                obj = orjson.loads(data_)
                if "error" in obj and not obj.get("choices"):
                    raise ValueError(f"error event in stream: {_error_message(data_.decode())}")
                text = _choice_text(obj, stream=True)
                if text:
                    rec.chunk_times.append(now)
                    parts.append(text)
                _take_usage(rec, obj.get("usage"))
                choices = obj.get("choices") or [{}]
                done = done or bool(choices[0].get("finish_reason")) or bool(obj.get("usage"))
        # a server may omit [DONE]; a finish reason or the usage chunk also says the answer is whole
        if not done:
            raise aiohttp.ClientPayloadError("stream ended without a finish_reason, usage or [DONE]")

    # ---------------------------------------------------------------------------------------
    # sessions and load shapes

    async def _run_session(
        self,
        http: aiohttp.ClientSession,
        session: Session,
        budget: _Budget,
        out: list[RequestRecord],
        cap: asyncio.Semaphore | None = None,
    ) -> None:
        """Send a session's rounds in order; `cap` bounds requests in flight (held per request, not
        across a session's think or tool time)."""
        context: list[dict[str, str]] = []
        for k, turn in enumerate(session.turns):
            if k > 0 and turn.delay_s > 0:
                await asyncio.sleep(turn.delay_s)
            if not budget.take():
                return
            # a tool's output goes back as a user message: every OpenAI-compatible server accepts it
            # (a `tool` message would need the model's real tool-call id), and counts stay exact
            context.append({"role": "user", "content": turn.text})
            if cap is None:
                rec = await self.send(
                    http, context, turn.max_tokens, session.session_id, k, len(session.turns) > 1
                )
            else:
                async with cap:
                    rec = await self.send(
                        http, context, turn.max_tokens, session.session_id, k, len(session.turns) > 1
                    )
            out.append(rec)
            if self.on_record:
                self.on_record(rec)
            if not rec.success:
                return  # the next round would need this answer
            context.append({"role": "assistant", "content": rec.text})

    async def _closed_loop(self, http, sessions: Iterator[Session], budget: _Budget, out: list) -> None:
        async def worker() -> None:
            while not budget.exhausted():
                try:
                    s = next(sessions)
                except StopIteration:
                    return
                await self._run_session(http, s, budget, out)

        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency or 1)))

    async def _open_loop(
        self, http, scheduled: Iterable[tuple[Session, float]], budget: _Budget, out: list
    ) -> None:
        """Start each session at its offset (seconds from now), whatever is still in flight."""
        sem = asyncio.Semaphore(self.cfg.concurrency) if self.cfg.concurrency else None
        t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()

        async def one(s: Session) -> None:
            await self._run_session(http, s, budget, out, sem)

        for s, t in scheduled:
            delay = t0 + t - time.perf_counter()
            # always yield to the loop, so that sessions start even when every arrival is due now
            await asyncio.sleep(max(delay, 0.0))
            if budget.exhausted():
                break
            task = asyncio.create_task(one(s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def run(self, workload: Iterator[list[TraceRecord]]) -> LoadResult:
        cfg = self.cfg
        sessions = (to_session(recs, cfg.block_size, i) for i, recs in enumerate(workload))
        prompt_corpus()  # built once, before the clock starts, not inside the first request's slot
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            if cfg.warmup:
                # warm-up: whole first rounds of their own sessions, at the run's concurrency
                warm: list[RequestRecord] = []
                wsessions = (Session(s.session_id, s.turns[:1]) for s in sessions)
                saved, self.on_record = self.on_record, None
                await self._closed_loop_n(http, wsessions, cfg.warmup, warm)
                self.on_record = saved
            out: list[RequestRecord] = []
            origin = time.perf_counter()
            wall = time.time()
            deadline = origin + cfg.duration_s if cfg.duration_s is not None else None
            budget = _Budget(cfg.num_requests, deadline)
            if cfg.mode == "concurrency":
                await self._closed_loop(http, sessions, budget, out)
            elif cfg.mode == "rate":
                proc = ArrivalProcess(cfg.rate or math.inf, cfg.burstiness, cfg.seed)
                taken = _take_sessions(sessions, cfg.num_requests)
                await self._open_loop(http, zip(taken, proc.times(), strict=False), budget, out)
            else:
                await self._open_loop(
                    http,
                    _on_schedule(_take_sessions(sessions, cfg.num_requests), cfg.time_scale),
                    budget,
                    out,
                )
        for r in out:
            r.start -= origin
            r.end -= origin
            r.chunk_times = [t - origin for t in r.chunk_times]
            if r.first_byte is not None:
                r.first_byte -= origin
        duration = (max(r.end for r in out) - min(r.start for r in out)) if out else 0.0
        return LoadResult(out, duration, wall, cfg.to_json())

    async def _closed_loop_n(self, http, sessions: Iterator[Session], n: int, out: list) -> None:
        await self._closed_loop(http, sessions, _Budget(n, None), out)


def _on_schedule(sessions: Iterator[Session], time_scale: float) -> Iterator[tuple[Session, float]]:
    """Each session with its trace offset from the first session, scaled."""
    t_first: float | None = None
    for s in sessions:
        if t_first is None:
            t_first = s.arrival_s
        yield s, max(0.0, (s.arrival_s - t_first) * time_scale)


def _take_sessions(sessions: Iterator[Session], num_requests: int | None) -> Iterator[Session]:
    """Enough sessions to cover `num_requests` rounds (all of them without a count bound)."""
    total = 0
    for s in sessions:
        if num_requests is not None and total >= num_requests:
            return
        total += len(s.turns)
        yield s


def _choice_text(obj: dict[str, Any], *, stream: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    part = c.get("delta" if stream else "message") or {}
    # reasoning tokens are output tokens too: the first of them ends the TTFT
    return (part.get("content") or "") + (part.get("reasoning_content") or part.get("reasoning") or "")


def _take_usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


def _error_message(body: str) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:300]


def run_load(
    cfg: LoadConfig,
    workload: Iterator[list[TraceRecord]],
    on_record: Callable[[RequestRecord], None] | None = None,
) -> LoadResult:
    """Run one load test to completion (blocking), with a rich progress bar if `cfg.progress`."""
    if not cfg.progress:
        return asyncio.run(LoadDriver(cfg, on_record).run(workload))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = cfg.num_requests
    with Progress(
        TextColumn("[bold]bench[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task("requests", total=total, status="")
        failed = 0

        def tick(rec: RequestRecord) -> None:
            nonlocal failed
            failed += not rec.success
            bar.update(task, advance=1, status=f"failed {failed}" if failed else "")
            if on_record:
                on_record(rec)

        return asyncio.run(LoadDriver(cfg, tick).run(workload))
