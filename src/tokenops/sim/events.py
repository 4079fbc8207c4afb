"""The simulator's clock: a binary-heap event loop over simulated seconds.

An event is a time, a tie-breaking sequence number and a callback with one argument. Events at the
same time run in the order they were scheduled, so a run is a pure function of its inputs and seed.
This module owns ordering and the clock only; what an event does is the fleet's and the engines'
business. A plain heap is used rather than a process-based library (SimPy) because every simulated
engine step is an event and a generator switch per step costs more than the step's own arithmetic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any


class EventLoop:
    """Run callbacks in simulated-time order; `now` is the time of the event being run."""

    __slots__ = ("now", "_heap", "_seq", "events_run")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, time: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule an event in the past ({time} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, arg))

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        if delay < 0:
            raise ValueError(f"cannot schedule an event in the past (delay {delay})")
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, fn, arg))

    def at_each(self, events: Iterable[tuple[float, Callable[[Any], None], Any]]) -> None:
        """Schedule many (time, callback, argument) events, the same as `at` for each in turn, but
        each enters the heap only when the one before it in time runs: a run's arrivals, known up
        front, do not make every heap operation of the run deeper."""
        pending = sorted(enumerate(events), key=lambda e: e[1][0])  # stable: ties in the order given
        pending.reverse()  # the next event last, to pop
        if not pending:
            return
        if pending[-1][1][0] < self.now:
            raise ValueError(f"cannot schedule an event in the past ({pending[-1][1][0]} < {self.now})")
        first = self._seq + 1
        self._seq += len(pending)
        stream = (pending, first)
        i, (t, _, _) = pending[-1]
        heapq.heappush(self._heap, (t, first + i, self._next_of, stream))

    def _next_of(self, stream: tuple[list, int]) -> None:
        pending, first = stream
        _, (_, fn, arg) = pending.pop()
        if pending:
            i, (t, _, _) = pending[-1]
            heapq.heappush(self._heap, (t, first + i, self._next_of, stream))
        fn(arg)

    def run(self, until: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        n = 0
        if until == float("inf"):
            while heap:  # the whole run: no bound to check per event
                t, _, fn, arg = pop(heap)
                self.now = t
                fn(arg)
                n += 1
        else:
            while heap and heap[0][0] <= until:
                t, _, fn, arg = pop(heap)
                self.now = t
                fn(arg)
                n += 1
        self.events_run += n

    def __len__(self) -> int:
        return len(self._heap)
