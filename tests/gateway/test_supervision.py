"""`tokenops serve` supervises its engines: a dead engine process is restarted and healthy again.
A bench stub stands in for the engine process (same /health contract, starts in a second)."""

from __future__ import annotations

import asyncio
import sys

from gateway_harness import free_port

from tokenops.config import EngineSpec
from tokenops.gateway.serve import SupervisedEngine, engine_command
from tokenops.gateway.upstream import Upstream


def test_engine_command_line() -> None:
    spec = EngineSpec(model="gemma-3-270m", port=9001, args={"max_num_seqs": 8, "no_prefix_caching": True, "x": False})
    cmd = engine_command(spec)
    assert cmd[-9:] == ["--model", "gemma-3-270m", "--host", "127.0.0.1", "--port", "9001", "--max-num-seqs", "8", "--no-prefix-caching"]


def test_dead_engine_is_restarted() -> None:
    async def scenario() -> None:
        port = free_port()
        spec = EngineSpec(port=port, startup_timeout_s=60)
        cmd = [sys.executable, "-c", "from tokenops.cli import app; app()", "bench", "stub", "--port", str(port)]
        engine = SupervisedEngine("stub", spec, command=cmd)
        probe = Upstream()
        try:
            engine.start_process()
            await engine.wait_healthy(probe)
            engine.supervise(probe)
            first = engine.process
            first.kill()
            for _ in range(600):
                await asyncio.sleep(0.1)
                if engine.restarts == 1 and await probe.get_ok(f"http://127.0.0.1:{port}/health"):
                    break
            assert engine.restarts == 1 and engine.process is not first
            assert await probe.get_ok(f"http://127.0.0.1:{port}/health")
        finally:
            engine.stop()
            await probe.close()
        assert engine.process.poll() is not None

    asyncio.run(scenario())
