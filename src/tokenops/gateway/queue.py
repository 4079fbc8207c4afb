"""The admission queue in front of a model's backends: a cap on requests in flight per backend, and
priority classes for who waits and who is refused when every backend is at its cap.

This module owns the in-flight counts of one gateway process and the waiting lines (one FIFO per
priority class, class 0 first). A free slot always goes to the highest class waiting; a class whose
line is full, or whose wait ran past its limit, is refused with a 429 that says so. The lowest
classes have the shortest lines and waits, so under load they are refused first. It does not pick
the priority (ops does, per key) nor talk to backends (upstream.py does).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from tokenops.config import QueueConfig
from tokenops.protocol import APIError


@dataclass(eq=False)
class Backend:
    """One OpenAI-compatible server for one model, with this process's count of requests on it."""

    url: str  # base URL ending in /v1
    served_name: str
    api_key: str | None
    max_inflight: int
    inflight: int = 0


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[Backend]
    priority: int


@dataclass(eq=False)
class BackendQueue:
    """Slots on one model's backends, handed out by priority class."""

    model: str
    backends: list[Backend]
    config: QueueConfig
    _lines: list[deque[_Waiter]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lines = [deque() for _ in self.config.classes]

    def waiting(self, priority: int | None = None) -> int:
        if priority is None:
            return sum(len(line) for line in self._lines)
        return len(self._lines[self._class(priority)])

    def _class(self, priority: int) -> int:
        return min(max(priority, 0), len(self._lines) - 1)

    def _free_backend(self) -> Backend | None:
        best: Backend | None = None
        for b in self.backends:
            if b.inflight < b.max_inflight and (best is None or b.inflight < best.inflight):
                best = b
        return best

    async def acquire(self, priority: int) -> Backend:
        """A backend slot; waits behind higher classes, raises 429 when the class's line or wait runs out."""
        cls = self._class(priority)
        # nobody of an equal or higher class is waiting and a slot is free: take it at once
        if not any(self._lines[c] for c in range(cls + 1)):
            backend = self._free_backend()
            if backend is not None:
                backend.inflight += 1
                return backend
        limits = self.config.classes[cls]
        line = self._lines[cls]
        if len(line) >= limits.max_queued:
            raise self._refusal(cls, f"its waiting line is full ({limits.max_queued} requests)")
        waiter = _Waiter(asyncio.get_running_loop().create_future(), cls)
        line.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout=limits.max_wait_s)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()  # granted in the same tick as the timeout
            raise self._refusal(cls, f"no slot freed within {limits.max_wait_s:g} s") from None
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # granted, but the caller is gone
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            try:
                line.remove(waiter)
            except ValueError:
                pass

    def release(self, backend: Backend) -> None:
        """Return a slot; the oldest waiter of the highest class waiting gets it."""
        backend.inflight -= 1
        for line in self._lines:
            while line:
                waiter = line.popleft()
                if waiter.future.done():
                    continue  # timed out or cancelled
                backend.inflight += 1
                waiter.future.set_result(backend)
                return

    def _refusal(self, cls: int, why: str) -> APIError:
        retry = self.config.retry_after_s
        return APIError(
            429,
            f"The backends of model '{self.model}' are at capacity and priority class {cls} was refused: {why}. "
            f"Retry after {retry} s, or use a key with a higher priority class.",
            type="rate_limit_error",
            code="backend_busy",
            headers={"retry-after": str(retry)},
        )
