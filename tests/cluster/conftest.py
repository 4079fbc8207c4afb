"""Shared fixtures for cluster tests: the asyncio backend for anyio tests, and loopback replicas
(in-process uvicorn servers, or real child processes for the kill and supervisor tests)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from tokenops.bench.ports import free_port
from tokenops.cluster.supervisor import ProcessSpec

from .replica_app import build_app

REPLICA_APP = Path(__file__).with_name("replica_app.py")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def serve_replicas(n: int) -> AsyncIterator[list[str]]:
    """n in-process replicas named r0..r{n-1}; yields their base URLs."""
    servers = []
    for i in range(n):
        port = free_port()
        config = uvicorn.Config(
            build_app(f"r{i}"), host="127.0.0.1", port=port, log_level="critical", lifespan="off"
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        servers.append((server, task, f"http://127.0.0.1:{port}"))
    for server, _, _ in servers:
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield [url for _, _, url in servers]
    finally:
        for server, _, _ in servers:
            server.should_exit = True
        await asyncio.gather(*(t for _, t, _ in servers))


def replica_process(name: str, port: int) -> ProcessSpec:
    argv = (sys.executable, str(REPLICA_APP), "--port", str(port), "--name", name)
    return ProcessSpec(name, argv, url=f"http://127.0.0.1:{port}")
