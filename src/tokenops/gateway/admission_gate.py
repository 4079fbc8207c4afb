"""The gateway's fair admission gate: at most N admitted requests in flight per model line (a fixed
number, or what the model's replica pool takes now: its replicas' adaptive concurrency limits), the
rest waiting in their (tenant, priority class) flow until the fair scheduler
(tokenops.ops.fair_queue) hands them a freed slot.

A request takes its slot before its budget is reserved (a waiter holds no money) and gives it back
after it settled. A slot is handed straight to the chosen waiter, so nobody who arrives meanwhile
can overtake the line. A waiter that gives up (its class's wait ran out, or the client left) leaves
its flow, and a slot granted to it at that very moment passes on to the next.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenops.config import FairQueueConfig, PriorityClass
from tokenops.ops.fair_queue import FairPolicy, FairScheduler, FairSnapshot, Waiter
from tokenops.protocol import APIError


@dataclass(eq=False)
class Slot:
    """One admitted request's place on a line; `release` is idempotent."""

    line: _Line | None
    waited_s: float = 0.0

    def release(self) -> None:
        line, self.line = self.line, None
        if line is not None:
            line.release()


@dataclass(eq=False)
class _Line:
    name: str
    capacity_of: Callable[[], int]  # read at every admission and hand-over: a pool's limit moves
    scheduler: FairScheduler
    clock: Callable[[], float]
    in_flight: int = 0
    waiting: dict[int, tuple[Waiter, asyncio.Future[None]]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # slots granted per tenant after a wait

    def queued(self, tenant: str) -> int:
        return sum(1 for w, _ in self.waiting.values() if w.tenant == tenant)

    def release(self) -> None:
        self.in_flight -= 1
        self.hand_over()

    @property
    def capacity(self) -> int:
        return self.capacity_of()

    def hand_over(self) -> None:
        while self.in_flight < self.capacity and self.waiting:
            snap = FairSnapshot(tuple(w for w, _ in self.waiting.values()), self.clock())
            choice = self.scheduler.choose(snap)
            assert choice is not None
            w, fut = self.waiting.pop(choice.waiter.id)
            self.in_flight += 1
            self.served[w.tenant] = self.served.get(w.tenant, 0) + 1
            fut.set_result(None)


class AdmissionGate:
    def __init__(
        self,
        config: FairQueueConfig,
        classes: list[PriorityClass],
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
        pool_capacity: Callable[[str], int | None] = lambda model: None,
    ) -> None:
        self.config = config
        self.pool_capacity = pool_capacity  # a real model's pool's capacity now; None: no such pool
        self.classes = classes
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.policy = FairPolicy(weights=dict(config.weights), aging_s=config.aging_s)
        self.lines: dict[str, _Line] = {}
        self._ids = itertools.count()

    def capacity(self, model: str) -> int | None:
        """How many of `model`'s requests may be admitted at once now; None: no limit, no line."""
        fixed = self.config.per_model.get(model, self.config.max_in_flight)
        pool = self.pool_capacity(model) if self.config.follow_pool else None
        if pool is None:
            return fixed
        return pool if fixed is None else min(fixed, pool)

    def line(self, model: str) -> _Line | None:
        line = self.lines.get(model)
        if line is None:
            if self.capacity(model) is None:
                return None

            def capacity_of() -> int:
                return self.capacity(model) or 1

            line = self.lines[model] = _Line(model, capacity_of, FairScheduler(self.policy), self.clock)
        return line

    async def enter(self, model: str, tenant: str, priority: int, cost: float = 1.0) -> Slot:
        """A slot on `model`'s line, waiting in the tenant's flow while the line is full. Raises 429
        when the tenant's flow is full or the class's wait runs out; cancellation leaves the flow."""
        line = self.line(model)
        if line is None:
            return Slot(None)
        if line.in_flight < line.capacity and not line.waiting:
            line.in_flight += 1
            return Slot(line)
        cls = self.classes[min(max(priority, 0), len(self.classes) - 1)]
        limit = self.config.max_queued_per_tenant
        if line.queued(tenant) >= limit:
            raise self._refused(
                model,
                f"tenant '{tenant}' already has {limit} requests waiting for it",
                "tenant_queue_full",
            )
        start = self.clock()
        w = Waiter(next(self._ids), tenant, priority, start, float(cost))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.waiting[w.id] = (w, fut)
        line.hand_over()  # a line whose capacity grew (a pool's limit) may take it at once
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=cls.max_wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if line.waiting.pop(w.id, None) is None and fut.done() and not fut.cancelled():
                line.release()  # granted just as it gave up: the slot passes on
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._refused(
                model,
                f"no slot freed within {cls.max_wait_s:g} s for priority class {priority}",
                "backend_busy",
            ) from None
        return Slot(line, self.clock() - start)

    def _refused(self, model: str, why: str, code: str) -> APIError:
        retry = self.retry_after_s
        return APIError(
            429,
            f"Model '{model}' is at its admission limit and the request was not queued: {why}. "
            f"Retry after {retry} s.",
            type="rate_limit_error",
            code=code,
            headers={"Retry-After": str(retry)},
        )

    def state(self) -> dict[str, dict[str, object]]:
        """Per line: capacity, in flight, waiting per tenant, served after a wait per tenant."""
        out: dict[str, dict[str, object]] = {}
        for name, line in self.lines.items():
            waiting: dict[str, int] = {}
            for w, _ in line.waiting.values():
                waiting[w.tenant] = waiting.get(w.tenant, 0) + 1
            out[name] = {
                "capacity": line.capacity,
                "in_flight": line.in_flight,
                "waiting": waiting,
                "served_after_wait": dict(line.served),
            }
        return out


__all__ = ["AdmissionGate", "Slot"]
