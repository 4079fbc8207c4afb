"""The gateway's own time on one request, measured from inside: `perf_counter_ns` stamps at the
edges of its path, so the latency it adds is read per request rather than as the difference of two
noisy end-to-end medians (through the gateway minus direct to the backend).

This module owns the stamps and what they mean; routes.py and sse.py take them, metrics.py exports
the intervals after the last byte is out (no histogram work before the client has its answer).

What the stamps do not see: uvicorn's parsing before the endpoint is called, the HTTP client's
own work between handing the request over and the first byte back (that lands in the backend's
time), and a wait for the event loop before a read from the backend is handed to the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

now_ns = time.perf_counter_ns


@dataclass(slots=True)
class PathTimer:
    """Stamps (perf_counter_ns, 0 = not reached) of one request's way through the gateway."""

    received: int  # the endpoint is called: the request line and headers are parsed
    upstream_sent: int = 0  # the first try's request is handed to the HTTP client (slot and body ready)
    upstream_in: int = 0  # first byte in from the backend (a non-streamed answer: all of it)
    client_first: int = 0  # first byte out: the send of the first body bytes returned
    last_in: int = 0  # the backend read that carried its last event
    done: int = 0  # the last byte out
    relay_ns: int = 0  # streams: read from the backend -> written to the client, summed over reads
    reads: int = 0  # the reads in relay_ns
    # set only with the diagnostic probes on (probes.py: aiohttp trace hooks on the upstream call)
    conn_ready: int = 0  # the upstream connection is ready: taken from the pool or just opened
    conn_new: bool = False  # ... and it was opened for this request
    body_sent: int = 0  # the request's headers and body were written to the socket
    resp_headers: int = 0  # the backend's status line and headers are in and parsed

    def sent(self) -> None:
        if not self.upstream_sent:  # retries and their backoff are the backend's time, not ours
            self.upstream_sent = now_ns()

    def relayed(self, read_at: int) -> None:
        """One backend read, taken at `read_at`, is written to the client."""
        t = now_ns()
        if not self.client_first:
            self.client_first = t
        self.relay_ns += t - read_at
        self.reads += 1

    def finished(self, read_at: int = 0) -> None:
        """The last byte is out; it carried the backend read taken at `read_at`, if given."""
        self.done = now_ns()
        if not self.client_first:
            self.client_first = self.done  # the whole answer left in one write
        if read_at:
            self.relay_ns += self.done - read_at
            self.reads += 1

    @property
    def relayed_all(self) -> bool:
        """Every stamp of a dispatched request that reached its client is set."""
        return bool(self.upstream_sent and self.upstream_in and self.last_in and self.done)
