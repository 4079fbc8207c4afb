"""`tokenops serve`: the whole platform in one process tree on a laptop.

This module owns the start-up sequence: read the config, start each model's local engine
(`tokenops engine --model ... --port ...`) as a supervised subprocess and wait for its `/health`,
open the ops façade (which creates the database and runs the migrations), on first start create an
admin key and a default organisation/project/key and print their plaintext once, then run the
gateway with uvicorn (uvloop, httptools) until interrupted, and stop the engines on the way out.
It does not serve requests itself (app.py) nor run models (the engine does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenops.config import EngineSpec, Settings
from tokenops.gateway.admin import hash_admin_key

log = logging.getLogger("tokenops.serve")

ADMIN_HASH_FILE = "admin_key.sha256"
DEFAULT_PATH = ("default", "default")  # organisation / project created on first start
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def _die_with_parent_hook() -> Any:
    """A pre-exec hook for the engine child: SIGTERM when `tokenops serve` dies, even by SIGKILL.

    libc is loaded here, in the parent, so the child between fork and exec only makes the call."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the engines are still stopped on a normal exit
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def engine_command(spec: EngineSpec) -> list[str]:
    """The engine's command line; knobs from the config become `--knob value` options."""
    cmd = [sys.executable, "-c", "from tokenops.cli import app; app()", "engine", "--model", spec.model]
    cmd += ["--host", spec.host, "--port", str(spec.port)]
    for key, value in spec.args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        else:
            cmd += [flag, str(value)]
    return cmd


@dataclass
class SupervisedEngine:
    """One engine subprocess, restarted with backoff when it dies."""

    name: str
    spec: EngineSpec
    command: list[str] | None = None  # default: `tokenops engine` with the spec's options
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    stopping: bool = False
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start_process(self) -> None:
        cmd = self.command or engine_command(self.spec)
        log.info("starting engine for %s: %s", self.name, " ".join(cmd))
        self.process = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent_hook())

    async def wait_healthy(self, upstream: Any) -> None:
        url = f"http://{self.spec.host}:{self.spec.port}/health"
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"the engine for '{self.name}' exited with status {code} during start-up")
            if await upstream.get_ok(url):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the engine for '{self.name}' was not healthy within {self.spec.startup_timeout_s:g} s ({url})")

    def supervise(self, upstream: Any) -> None:
        self._task = asyncio.ensure_future(self._watch(upstream))

    async def _watch(self, upstream: Any) -> None:
        while not self.stopping:
            await asyncio.sleep(1.0)
            if self.process is None or self.process.poll() is None or self.stopping:
                continue
            delay = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.error("engine for %s exited with status %s; restarting in %.0f s", self.name, self.process.returncode, delay)
            await asyncio.sleep(delay)
            self.restarts += 1
            self.start_process()
            try:
                await self.wait_healthy(upstream)
                log.info("engine for %s is back", self.name)
            except RuntimeError as exc:
                log.error("%s", exc)

    def stop(self) -> None:
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def ensure_admin_key(settings: Settings) -> tuple[tuple[str, ...], str | None]:
    """The admin key hashes to accept, and a new plaintext admin key when this is the first start."""
    if settings.admin_key:
        return (), None  # the config names one; nothing to create
    path = settings.data_dir / ADMIN_HASH_FILE
    if path.is_file():
        return (path.read_text().strip(),), None
    key = "tok-admin-" + secrets.token_urlsafe(32)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(hash_admin_key(key) + "\n")
    path.chmod(0o600)
    return (path.read_text().strip(),), key


async def bootstrap_tenant(ops: Any) -> str | None:
    """On an empty database: create the default organisation, project and key; return its plaintext."""
    if await ops.list_nodes():
        return None
    await ops.create_node((), DEFAULT_PATH[0], {})
    await ops.create_node(DEFAULT_PATH[:1], DEFAULT_PATH[1], {})
    plaintext, _ = await ops.create_key(DEFAULT_PATH, "default", {})
    return plaintext


def print_first_start(url: str, model: str, admin_key: str | None, api_key: str | None) -> None:
    if not admin_key and not api_key:
        return
    lines = ["", "tokenops: first start. These keys are shown once; they are stored only as hashes.", ""]
    if admin_key:
        lines.append(f"  admin key (for /admin/ and the admin API):  {admin_key}")
    if api_key:
        lines.append(f"  API key for {'/'.join(DEFAULT_PATH)}:                 {api_key}")
        lines += [
            "",
            "  from openai import OpenAI",
            f'  client = OpenAI(base_url="{url}/v1", api_key="{api_key}")',
            f'  client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi"}}])',
        ]
    lines.append("")
    print("\n".join(lines), flush=True)


async def run(settings: Settings) -> None:
    """Start engines, open ops, bootstrap, serve until interrupted."""
    import uvicorn

    from tokenops.gateway.app import create_app, open_operations
    from tokenops.gateway.upstream import Upstream

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    hashes, new_admin_key = ensure_admin_key(settings)
    probe = Upstream(connect_timeout_s=2.0, read_timeout_s=5.0)
    engines = [SupervisedEngine(name, m.engine) for name, m in settings.models.items() if m.engine is not None]
    ops = None
    try:
        for engine in engines:
            engine.start_process()
        for engine in engines:
            await engine.wait_healthy(probe)
            engine.supervise(probe)
        ops = await open_operations(settings)
        api_key = await bootstrap_tenant(ops)
        app = create_app(settings, ops=ops, admin_key_hashes=hashes)
        url = f"http://{settings.host}:{settings.port}"
        print_first_start(url, next(iter(settings.models)), new_admin_key, api_key)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            http="httptools",
            log_level=settings.log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        log.info("gateway listening on %s", url)
        await uvicorn.Server(config).serve()
    finally:
        for engine in engines:
            engine.stop()
        await probe.close()
        if ops is not None:
            await ops.close()


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(settings))
