"""Helpers for the gateway tests: the bench stub as the remote provider, a real gateway on a loopback
port (uvicorn in a thread, its own event loop, a SQLite ledger in a temp dir), small helpers to
create keys through the admin API and read the ledger, and the loads the budget tests put on real
gateway processes (counted streams with a SIGKILL among them, a race for a budget)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import sqlalchemy as sa

from tokenops.config import Settings, load_settings
from tokenops.gateway.app import create_app
from tokenops.gateway.connections import uvicorn_options
from tokenops.ops.db import engine_url

ADMIN_KEY = "test-admin-key"
MODEL = "stub-model"


class LoopbackServer:
    """A raw TCP server on a loopback port, in a thread with its own event loop; a subclass says in
    `_handle` what it does with each connection (a backend that misbehaves on purpose)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:  # close the listener, the connections still open and the loop, in the loop's own thread
            server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def gateway_settings(stub_url: str, data_dir: Path, **extra: Any) -> Settings:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "data_dir": data_dir,
        "admin_key": ADMIN_KEY,
        "max_body_bytes": 64 * 1024,
        "models": {
            MODEL: {
                "backends": [stub_url + "/v1"],
                "context_window": 4096,
                "template_overhead_tokens": 16,
                "pricing": {"input": 1.0, "output": 2.0},
            }
        },
    }
    base.update(extra)
    return load_settings(None, environ={}, overrides=base)


@dataclass
class RunningGateway:
    url: str
    settings: Settings
    app: Any
    _stop: Callable[[], None]
    _admin: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self._admin = httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )

    def stop(self) -> None:
        self._admin.close()
        self._stop()

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self._admin.request(method, path, **kw)

    def new_key(
        self, name: str, limits: dict[str, Any] | None = None, org: str = "org", project: str = "proj"
    ) -> str:
        """A fresh key under org/project (created on demand) with these limits on the key's node."""
        self.admin("POST", "/admin/tenants", json={"parent": None, "name": org})
        self.admin("POST", "/admin/tenants", json={"parent": org, "name": project})
        r = self.admin(
            "POST", "/admin/keys", json={"node": f"{org}/{project}", "name": name, "limits": limits or {}}
        )
        assert r.status_code == 201, r.text
        return r.json()["key"]

    def client(self, key: str | None, **kw: Any) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", **kw)

    def async_client(self, key: str, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, **kw)

    def ledger(self, **where: Any) -> list[dict[str, Any]]:
        engine = sa.create_engine(engine_url(self.settings.resolved_database_url))
        schema = self.settings.database_schema
        try:
            with engine.connect() as conn:
                q = f'SELECT * FROM "{schema}".ops_ledger' if schema else "SELECT * FROM ops_ledger"
                if where:
                    q += " WHERE " + " AND ".join(f"{k} = :{k}" for k in where)
                return [dict(r._mapping) for r in conn.execute(sa.text(q + " ORDER BY id"), where)]
        finally:
            engine.dispose()

    def wait_ledger(self, expected: int, timeout: float = 10.0, **where: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            rows = self.ledger(**where)
            if len(rows) >= expected or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


def start_gateway(settings: Settings, probes: bool = False) -> RunningGateway:
    """Serve a gateway on a free loopback port in a daemon thread (uvloop + httptools with serve's
    connection limits);
    `probes`: with the diagnostic probes on (`tokenops serve --probes`)."""
    import uvicorn

    app = create_app(settings, probes=probes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            **uvicorn_options(settings.connections),
        )
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"gateway-{port}"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return RunningGateway(f"http://127.0.0.1:{port}", settings, app, stop)


@dataclass
class StreamTally:
    """Streams of a load: `started` counts those whose first chunk arrived, `finished` those that
    ended with a finish reason (a stream cut by a killed gateway may end without an error)."""

    started: int = 0
    finished: int = 0


async def counted_stream(
    client: openai.AsyncOpenAI, i: int, tally: StreamTally, max_tokens: int = 30
) -> None:
    """One streamed chat completion, counted in `tally`; the SDK's and httpx's errors pass through."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"tell me {i}"}],
        max_tokens=max_tokens,
        stream=True,
    )
    first, done = True, False
    async for chunk in stream:
        if first:
            tally.started += 1
            first = False
        done = done or any(c.finish_reason for c in chunk.choices)
    tally.finished += done


async def kill_when_started(pid: int, tally: StreamTally, started: int) -> None:
    """SIGKILL `pid` once `started` streams of `tally` have their first chunk."""
    while tally.started < started:
        await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


async def budget_race(urls: list[str], key: str, n: int = 200) -> list[str]:
    """`n` requests at once spread over the gateways at `urls`, half streamed: each one's result is
    "ok" or the code of its 429."""

    async def one(i: int, client: openai.AsyncOpenAI) -> str:
        try:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=8,
                stream=i % 4 < 2,
            )
            return "ok"
        except openai.RateLimitError as e:
            return e.code or "429"

    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=key, max_retries=0) for u in urls]
    return await asyncio.gather(*(one(i, clients[i % len(clients)]) for i in range(n)))
