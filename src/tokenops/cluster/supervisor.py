"""Supervise local replica processes: start N `tokenops engine` servers on given ports and restart one
that dies, with backoff and a cap on restarts per minute.

Processes are spawned with asyncio subprocesses, so any command works (the tests supervise a small
loopback server). A restart calls `on_restart(name)` so the pool can forget that replica's cached
prefixes (its KV cache died with it). This module does not route or health-check: a restarted replica
comes back through its breaker's half-open state and slow start in `pool.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger("tokenops.cluster.supervisor")


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the parent's environment
    url: str = ""  # where it serves, for `wait_ready`


def engine_specs(
    ports: Sequence[int], args: Sequence[str] = (), host: str = "127.0.0.1", prefix: str = "engine"
) -> list[ProcessSpec]:
    """One local `tokenops engine` server per port, named `{prefix}-{i}`, each with the same `args`."""
    specs = []
    for i, port in enumerate(ports):
        argv = (sys.executable, "-c", "from tokenops.cli import app; app()", "engine")
        argv += ("--host", host, "--port", str(port), *args)
        specs.append(ProcessSpec(f"{prefix}-{i}", argv, url=f"http://{host}:{port}"))
    return specs


def _die_with_parent() -> Callable[[], object] | None:
    """A pre-exec hook: the child gets SIGTERM when the supervising process dies, even by SIGKILL.

    libc is loaded here, in the parent, so the child between fork and exec only makes the call."""
    try:
        import ctypes
        import signal

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: children are still stopped by `stop()` on a normal exit
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Supervisor:
    def __init__(
        self,
        specs: Iterable[ProcessSpec],
        *,
        restart_delay: float = 0.5,
        max_restart_delay: float = 10.0,
        max_restarts_per_minute: int = 10,
        on_restart: Callable[[str], None] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.restart_delay = restart_delay
        self.max_restart_delay = max_restart_delay
        self.max_restarts_per_minute = max_restarts_per_minute
        self.on_restart = on_restart
        self.log_dir = log_dir
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = dict.fromkeys(self.specs, 0)
        self.gave_up: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._preexec = _die_with_parent()

    def pid(self, name: str) -> int | None:
        proc = self.processes.get(name)
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self) -> None:
        self._stopping = False
        for name in self.specs:
            await self._spawn(name)
            self._tasks[name] = asyncio.create_task(self._watch(name), name=f"supervise-{name}")

    async def _spawn(self, name: str) -> None:
        spec = self.specs[name]
        out: int | object = asyncio.subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.processes[name] = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **spec.env},
                preexec_fn=self._preexec,
            )
        finally:
            if hasattr(out, "close"):
                out.close()  # type: ignore[union-attr]

    async def _watch(self, name: str) -> None:
        recent: deque[float] = deque()
        delay = self.restart_delay
        while True:
            proc = self.processes[name]
            started = time.monotonic()
            rc = await proc.wait()
            if self._stopping:
                return
            now = time.monotonic()
            recent.append(now)
            while recent and now - recent[0] > 60:
                recent.popleft()
            if len(recent) > self.max_restarts_per_minute:
                log.error("%s exited (rc=%s) %d times in a minute; not restarting", name, rc, len(recent))
                self.gave_up.add(name)
                return
            # a process that ran a while resets the backoff; one that dies at once backs off
            delay = self.restart_delay if now - started > 30 else min(delay * 2, self.max_restart_delay)
            log.warning("%s exited (rc=%s); restarting in %.1fs", name, rc, delay)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(name)
            self.restarts[name] += 1
            if self.on_restart is not None:
                self.on_restart(name)

    async def stop(self, timeout: float = 5.0) -> None:
        """Terminate every process (SIGTERM, then SIGKILL after `timeout`) and stop watching."""
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

        async def end(proc: asyncio.subprocess.Process) -> None:
            if proc.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

        await asyncio.gather(*(end(p) for p in self.processes.values()))

    async def wait_ready(self, path: str = "/health", timeout: float = 60.0) -> None:
        """Wait until every spec with a `url` answers `path` with a non-5xx status."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            for spec in self.specs.values():
                if not spec.url:
                    continue
                while True:
                    if spec.name in self.gave_up:
                        raise RuntimeError(f"{spec.name} kept exiting during start-up (see its log); gave up")
                    try:
                        if (await client.get(spec.url + path, timeout=1.0)).status_code < 500:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{spec.name} at {spec.url} not ready after {timeout:g}s")
                    await asyncio.sleep(0.1)
