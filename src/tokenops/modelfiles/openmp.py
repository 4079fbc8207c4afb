"""One busy OpenMP thread pool per process: give back the pools of threads that stopped computing.

PyTorch's CPU ops run their parallel regions on OpenMP (libgomp in the Linux wheels), which keeps a
pool of worker threads for every thread that ever ran a parallel region, for the life of that
thread. Between regions the workers spin briefly before sleeping, which is what makes a decode
step's hundreds of small parallel regions cheap to start. But libgomp counts every pool's workers,
idle ones included, and once they outnumber the CPUs it cuts that spin to ~1,000 iterations for
all of them: every region then pays a futex wake-up on each side.

That is exactly the engine's shape: the model is loaded (and quantised) on the main thread, whose
pool then sits idle, and the engine thread steps it with a pool of its own, so a decode step on the
engine thread ran measurably slower than on the main thread until the main thread's pool was given
back (docs/engine-core.md, "Threads"). `release_thread_pool()` gives the calling thread's pool back
(`omp_pause_resource_all(omp_pause_soft)`, OpenMP 5.0); a later parallel region on that thread
simply builds a new one.

Call it on a thread that is done computing for a while: `AsyncEngine.start` calls it on the thread
that loaded the model, before the engine thread takes over (`claim_for_engine_thread`), and so does
`serve_in_thread`; the sentence embedder gives its worker thread's pool back after each `embed` when
an engine thread runs in the process (`release_if_engine_runs`). With libgomp the release concerns
the calling thread's pool only; LLVM's and Intel's runtimes pause the whole process (their workers
restart on the next region).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

__all__ = ["claim_for_engine_thread", "openmp_runtime", "release_if_engine_runs", "release_thread_pool"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads stopped, state kept
_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU (PyTorch's Linux wheels), Intel, LLVM


_runtime: ctypes.CDLL | None = None


def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (through torch), or None (not Linux, none loaded
    yet, or one without OpenMP 5.0's pause API). Found once, then remembered."""
    global _runtime
    if _runtime is None:
        _runtime = _find_runtime()
    return _runtime


def _find_runtime() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    # torch's own copy first: another package may bring a second libgomp whose pools torch never uses
    torch_lib = (
        os.path.join(os.path.dirname(torch.__file__), "") if (torch := sys.modules.get("torch")) else None
    )
    for path in sorted(paths, key=lambda p: (not (torch_lib and p.startswith(torch_lib)), p)):
        name = os.path.basename(path)
        if name.startswith(_RUNTIMES) and ".so" in name:
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle, no second copy
                pause = lib.omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes = [ctypes.c_int]
            pause.restype = ctypes.c_int
            return lib
    return None


def release_thread_pool() -> bool:
    """Give back the calling thread's idle OpenMP worker threads; True when the runtime took the
    request. A process that has not loaded an OpenMP runtime has no pool: False. Never call it from
    inside a parallel region (the runtime refuses: False)."""
    lib = openmp_runtime()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("the OpenMP runtime kept this thread's pool")
    return ok


_engine_thread = False  # set once an engine thread computes in this process


def claim_for_engine_thread() -> None:
    """Called by the thread that starts an engine thread (`AsyncEngine.start`): give this thread's pool
    back, and from now on let other occasional torch users give theirs back too."""
    global _engine_thread
    _engine_thread = True
    release_thread_pool()


def release_if_engine_runs() -> bool:
    """`release_thread_pool()` where an engine thread computes in this process; else nothing (a gateway
    without an embedded engine keeps its embedder's pool rather than rebuilding it per call)."""
    return release_thread_pool() if _engine_thread else False
