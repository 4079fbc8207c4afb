"""The background loops of the cluster and the gateway: one task each, started once and stopped cleanly.

`BackgroundTask` owns starting a coroutine as a named task (a second start is a no-op) and stopping
it (cancel, then wait for it to end); `poll_every` is the loop of the load poller and the health
checker: one round per interval over a shared HTTP client, a failed round logged and never the end
of the loop. What a round does stays with its owner (`load_poller`, `health`, `gateway.probes`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from logging import Logger
from typing import Any

import httpx


class BackgroundTask:
    """One named task running `run()`; `start` twice runs it once, `stop` waits for it to end."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._run = run
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def poll_every(
    interval: float, round_: Callable[[httpx.AsyncClient], Awaitable[object]], log: Logger, what: str
) -> None:
    """Run `round_` every `interval` seconds until cancelled; a round that raises is logged on `log`."""
    async with httpx.AsyncClient() as client:
        while True:
            try:
                await round_(client)
            except Exception:  # a bug in one round must not silently end the loop
                log.exception("%s round failed", what)
            await asyncio.sleep(interval)
