"""Ending a request's work when its client goes away: `ClientWatch`.

This module owns one mechanism, used by the SSE relay and by a whole (non-streamed) answer alike: a
watcher task waits for the client's `http.disconnect` and then cancels the request's own task, so
whatever it awaits (a replica slot, the backend's headers, the body) ends at once and the cluster
closes the upstream connection (the replica stops generating and frees its slot). The cancellation
it caused is swallowed at the end of the `async with` block; a cancellation of the gateway itself
propagates. It does not decide what is billed or sent.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from tokenops.gateway.http import Receive, wait_disconnect


class ClientWatch:
    """`async with ClientWatch(receive) as watch:` runs the block in the caller's task and cancels it
    when the client disconnects; `watch.gone` then says so. `disarm()` before the last write of a
    whole response: uvicorn reports a disconnect once a response is complete, too."""

    __slots__ = ("_receive", "_task", "_watcher", "_armed", "gone")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._armed = True
        self.gone = False

    async def __aenter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(wait_disconnect(self._receive))
        self._watcher.add_done_callback(self._went_away)
        return self

    def _went_away(self, watcher: asyncio.Future[None]) -> None:
        # a callback that runs after the block ended (or was disarmed) must not cancel what follows
        if self._armed and not watcher.cancelled() and self._task is not None:
            self.gone = True
            self._task.cancel()

    def client_gone(self) -> bool:
        """The client's disconnect has arrived (the cancellation may still be on its way)."""
        return self._watcher is not None and self._watcher.done()

    def disarm(self) -> None:
        self._armed = False

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._armed = False
        if self._watcher is not None:
            self._watcher.cancel()
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError) and self.gone:
            # uncancel() counts the cancellations still pending: one of the gateway itself propagates
            assert self._task is not None
            return self._task.uncancel() == 0
        return False
