"""The machine's shared benchmark lock, taken by a script only for its timed part.

Peers that take minutes to start (vLLM compiles its model) load and warm up before the lock, so
that whoever else measures on the machine waits only for the timing itself.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator


@contextlib.contextmanager
def bench_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (the file `flock PATH command` takes); None: no lock."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
