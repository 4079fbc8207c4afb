"""The bridge between the asyncio HTTP server and the synchronous engine. `AsyncEngine` owns one
dedicated thread, the only caller of `LLMEngine` (which is not thread-safe): it takes new requests
and aborts from a thread-safe inbox between steps, runs `LLMEngine.step()` while there is work and
sleeps on the inbox when there is none, and hands each step's outputs to per-request asyncio queues
in one `call_soon_threadsafe` call, so the engine thread never waits on the event loop. An exception
inside the engine is delivered to every request it was serving, which are aborted, and the loop
carries on. After every step the thread publishes the engine's `LoadSnapshot` and moves the pool's
KV events into a bounded log, which `/v1/load`, `/metrics` and `/v1/kv_events` read without touching
the engine. This module does not parse HTTP, detokenise or apply stop strings (the server does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenops.engine.config import RequestRejected
from tokenops.engine.load import LoadSnapshot
from tokenops.engine.sampling_params import SamplingParams
from tokenops.modelfiles.openmp import claim_for_engine_thread

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the caller's fault)."""


class KVEventLog:
    """The last N KV events, read by sequence number (`since`) by any number of pollers."""

    def __init__(self, capacity: int) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def extend(self, events: list[Any]) -> None:
        rows = [
            {
                "seq_no": e.seq_no,
                "kind": e.kind,
                "block_hash": e.block_hash,
                "block_id": e.block_id,
                "parent_hash": e.parent_hash,
                "token_ids": list(e.token_ids) if e.token_ids is not None else None,
            }
            for e in events
        ]
        with self._lock:
            self._events.extend(rows)

    def since(self, seq_no: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """Events with `seq_no >= since` (at most `limit`), and the oldest seq_no still held."""
        with self._lock:
            oldest = self._events[0]["seq_no"] if self._events else seq_no
            out = [e for e in self._events if e["seq_no"] >= seq_no][:limit]
        return out, oldest


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    hold_kv: bool = False
    kv_import: Any = None  # a kv_transfer.KVImport


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps (KV transfer bookkeeping)."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


Sink = asyncio.Queue


class AsyncEngine:
    """Drives one `LLMEngine` from a dedicated thread; asyncio callers submit and await outputs.

    `submit()` returns an asyncio queue that receives the request's `StepOutput`s in order (the last
    one has `finished=True`), or one exception (`RequestRejected`, `EngineError`) instead.
    """

    def __init__(self, engine: Any, *, kv_event_capacity: int = 10_000) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # touched only on the event loop's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # requests inside the engine; touched only by the engine thread
        self.load = LoadSnapshot()
        self.kv_events = KVEventLog(kv_event_capacity)
        self.last_error: str | None = None
        self.steps = 0
        self._publish()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        # the model was loaded on this thread: its idle OpenMP pool would throttle the engine
        # thread's (modelfiles/openmp.py); from here on only the engine thread computes
        claim_for_engine_thread()
        self._thread = threading.Thread(target=self._run, name="tokenops-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- called on the event loop -----------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        sink: Sink | None = None,
        *,
        hold_kv: bool = False,
        kv_import: Any = None,
    ) -> Sink:
        """Queue a request for the engine; its outputs arrive on `sink` (a new queue unless given)."""
        if not self.alive:
            raise EngineError("the engine is not running")
        if request_id in self._sinks:
            raise ValueError(f"duplicate request id {request_id!r}")
        sink = sink if sink is not None else asyncio.Queue()
        self._sinks[request_id] = sink
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, priority, hold_kv, kv_import))
        return sink

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` run on the engine thread before its next step; its result or exception."""
        if not self.alive:
            raise EngineError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Stop a request now (client gone, stop string matched); its blocks are freed at once."""
        if self._sinks.pop(request_id, None) is not None:
            self._inbox.put(_Abort(request_id))

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            sink = self._sinks.get(request_id)
            if sink is None:  # aborted meanwhile
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._sinks[request_id]
            sink.put_nowait(item)

    # -- the engine thread ------------------------------------------------------------------------

    def _send(self, items: list[tuple[str, Any]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave clients hanging
            log.exception("engine thread died")
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(
                    self._fail_all_sinks, EngineError(f"the engine stopped: {exc}")
                )

    def _serve(self) -> None:
        engine = self.engine
        while True:
            # sleep on the inbox when there is nothing to step; otherwise only drain it
            block = not engine.has_unfinished()
            rejected: list[tuple[str, Any]] = []
            try:
                cmd = self._inbox.get(block=block)
                while True:
                    if isinstance(cmd, _Stop):
                        self._abort_all(EngineError("the engine is shutting down"))
                        return
                    self._apply(cmd, rejected)
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                pass
            self._send(rejected)
            if engine.has_unfinished():
                self._step()
            self._publish()

    def _fail_all_sinks(self, error: Exception) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.put_nowait(error)

    def _apply(self, cmd: _Add | _Abort | _Call, rejected: list[tuple[str, Any]]) -> None:
        if isinstance(cmd, _Call):
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                cmd.future.set_exception(exc)
            return
        if isinstance(cmd, _Abort):
            if cmd.request_id in self._live:
                self._live.discard(cmd.request_id)
                try:
                    self.engine.abort(cmd.request_id)
                except Exception:  # noqa: BLE001 - an abort must never take the loop down
                    log.exception("abort of %s failed", cmd.request_id)
            return
        try:
            if cmd.hold_kv or cmd.kv_import is not None:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.params,
                    priority=cmd.priority,
                    hold_kv=cmd.hold_kv,
                    kv_import=cmd.kv_import,
                )
            else:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, priority=cmd.priority
                )
        except RequestRejected as exc:
            rejected.append((cmd.request_id, exc))
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("add_request %s failed", cmd.request_id)
            rejected.append((cmd.request_id, EngineError(f"the engine could not accept the request: {exc}")))
            return
        self._live.add(cmd.request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._abort_all(EngineError(f"the engine failed while generating: {self.last_error}"))
            return
        self.steps += 1
        items = []
        for out in outputs:
            items.append((out.request_id, out))
            if out.finished:
                self._live.discard(out.request_id)
        self._send(items)

    def _abort_all(self, error: Exception) -> None:
        items = []
        for request_id in list(self._live):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", request_id)
            items.append((request_id, error))
        self._live.clear()
        self._send(items)

    def _publish(self) -> None:
        engine = self.engine
        try:
            self.load = engine.load()
        except Exception:  # noqa: BLE001 - observability must not break serving
            log.exception("load snapshot failed")
        drain: Callable[[], list[Any]] | None = getattr(engine, "drain_kv_events", None)
        if drain is not None:
            try:
                events = drain()
            except Exception:  # noqa: BLE001
                log.exception("kv event drain failed")
                events = []
            if events:
                self.kv_events.extend(events)
