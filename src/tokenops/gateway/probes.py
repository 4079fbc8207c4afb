"""Diagnostic probes of the gateway process, off unless asked for (`tokenops serve --probes`): where a
request's time goes between the gateway's own stamps (timing.py).

Two probes, both exported on /metrics by metrics.py:

- `LoopProbe`: a task that sleeps `interval` (1 ms) and records how late it woke (the sleep's
  overshoot: the event loop was busy, or the process waited for a core), then schedules one callback
  and records how long it waited to run: the cost of one pass of the event loop at that moment,
  which is what every `await` that hands work to another task (uvicorn starting a request, aiohttp's
  body writer, a relay waking for a read) pays on the request path.
- `upstream_trace_config()`: aiohttp `TraceConfig` hooks on the cluster's upstream session that stamp
  the request's `PathTimer` (found through the `CURRENT` context variable, which the endpoint sets):
  connection ready (pooled or new), request body written to the socket, response headers parsed. With
  `upstream_sent` and `upstream_in` they split the upstream call into the gateway's side (getting a
  connection, writing) and the backend's.

With the probes on, a response also carries its stamps so far in an `x-tokenops-timing` header
(`timing_header`), for a load generator on the same host to line them up with its own clock.

This module measures and records; it changes nothing on the request path but the stamps. The hooks
cost a few microseconds per upstream request, the loop probe about a thousand wake-ups a second,
hence off by default.
"""

from __future__ import annotations

import asyncio
import re
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

import aiohttp

from tokenops.cluster.background import BackgroundTask
from tokenops.gateway.timing import PathTimer, now_ns

# the request being served by the current task (set by the endpoint; read by the trace hooks, which
# run in the request's task or in the body-writer task it creates, whose context is a copy)
CURRENT: ContextVar[PathTimer | None] = ContextVar("tokenops_gateway_timer", default=None)


class LoopProbe:
    """Sleeps `interval` seconds in a loop; observes the overshoot into `lag` and the wait of one
    `call_soon` callback into `one_pass` (histogram children or anything with `observe(seconds)`)."""

    def __init__(self, lag: Any, one_pass: Any, interval: float = 0.001) -> None:
        self.lag = lag
        self.one_pass = one_pass
        self.interval = interval
        self._task = BackgroundTask(self._run, "gateway-loop-probe")

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval_ns = int(self.interval * 1e9)
        while True:
            t0 = now_ns()
            await asyncio.sleep(self.interval)
            t1 = now_ns()
            self.lag.observe(max(0, t1 - t0 - interval_ns) / 1e9)
            loop.call_soon(self._passed, t1)

    def _passed(self, scheduled: int) -> None:
        self.one_pass.observe((now_ns() - scheduled) / 1e9)


async def _on_connection_ready(_: Any, ctx: SimpleNamespace, __: Any) -> None:
    timer = CURRENT.get()
    if timer is not None and not timer.conn_ready:
        timer.conn_ready = now_ns()


async def _on_connection_created(_: Any, ctx: SimpleNamespace, __: Any) -> None:
    timer = CURRENT.get()
    if timer is not None and not timer.conn_ready:
        timer.conn_ready = now_ns()
        timer.conn_new = True


async def _on_body_sent(_: Any, ctx: SimpleNamespace, __: Any) -> None:
    timer = CURRENT.get()
    if timer is not None and not timer.body_sent:
        timer.body_sent = now_ns()


async def _on_response_headers(_: Any, ctx: SimpleNamespace, __: Any) -> None:
    timer = CURRENT.get()
    if timer is not None and not timer.resp_headers:
        timer.resp_headers = now_ns()


TIMING_HEADER = b"x-tokenops-timing"
_STAMPS = re.compile(r"[a-z_]+=\d+(,[a-z_]+=\d+)*")
TIMING_FIELDS = ("received", "upstream_sent", "conn_ready", "body_sent", "resp_headers", "upstream_in")


def timing_header(timer: PathTimer, upstream: str | None = None) -> tuple[bytes, bytes]:
    """The request's stamps so far as a response header (`x-tokenops-timing: received=<ns>,...`),
    followed by `;` and the backend's own `upstream` stamps when it sent some (the bench stub's
    `x-stub-timing`).

    `perf_counter_ns` is CLOCK_MONOTONIC on Linux, one clock for every process on the machine, so a
    client on the same host can place the gateway's stamps on its own timeline (the benchmark does)."""
    value = ",".join(f"{f}={getattr(timer, f)}" for f in TIMING_FIELDS)
    if upstream and _STAMPS.fullmatch(upstream):  # any backend may send the header: pass only stamps
        value += ";" + upstream
    return TIMING_HEADER, value.encode("latin-1")


def upstream_trace_config() -> aiohttp.TraceConfig:
    """Hooks that stamp the current request's timer at the upstream call's steps (first try only)."""
    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(_on_connection_ready)
    tc.on_connection_create_end.append(_on_connection_created)
    tc.on_request_chunk_sent.append(_on_body_sent)  # the body-writer task wrote headers + body
    tc.on_request_end.append(_on_response_headers)  # status line and headers in and parsed
    tc.freeze()
    return tc
