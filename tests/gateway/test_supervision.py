"""`tokenops serve` supervises its engines with the cluster's `Supervisor` (one supervisor in the
project; its restart behaviour is tested in tests/cluster/test_failover.py). Here: the engine command
line, replicas on consecutive ports, and a killed engine restarted with the cluster told to forget
its cached prefixes. A bench stub stands in for the engine process (same /health contract)."""

from __future__ import annotations

import asyncio
import sys

import httpx

from tokenops.bench.ports import free_port
from tokenops.cluster.supervisor import ProcessSpec, Supervisor
from tokenops.config import EngineSpec, load_settings
from tokenops.gateway.serve import engine_command, engine_processes


def test_engine_command_line() -> None:
    spec = EngineSpec(
        model="gemma-3-270m", port=9001, args={"max_num_seqs": 8, "no_prefix_caching": True, "x": False}
    )
    cmd = engine_command(spec)
    assert cmd[-9:] == [
        "--model",
        "gemma-3-270m",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--max-num-seqs",
        "8",
        "--no-prefix-caching",
    ]


def test_engine_replicas_run_on_consecutive_ports_and_join_the_pool() -> None:
    settings = load_settings(
        None,
        environ={},
        overrides={
            "models": {
                "org/small": {
                    "engine": {"port": 9100, "replicas": 3},
                    "backends": ["http://10.0.0.1:8000/v1"],
                }
            }
        },
    )
    specs = engine_processes(settings)
    assert [s.name for s in specs] == ["org_small-0", "org_small-1", "org_small-2"]
    assert [s.argv[s.argv.index("--port") + 1] for s in specs] == ["9100", "9101", "9102"]
    assert settings.models["org/small"].backend_urls() == [
        "http://10.0.0.1:8000/v1",
        "http://127.0.0.1:9100/v1",
        "http://127.0.0.1:9101/v1",
        "http://127.0.0.1:9102/v1",
    ]
    from tokenops.cluster import build_cluster

    pool = build_cluster(settings.models, settings.cluster).pools["org/small"]
    assert sorted(r.spec.kind for r in pool.replicas.values()) == [
        "openai",
        "tokenops",
        "tokenops",
        "tokenops",
    ]


def test_dead_engine_is_restarted_and_reported() -> None:
    async def scenario() -> None:
        port = free_port()
        argv = (
            sys.executable,
            "-c",
            "from tokenops.cli import app; app()",
            "bench",
            "stub",
            "--port",
            str(port),
        )
        restarted: list[str] = []
        sup = Supervisor(
            [ProcessSpec("stub-0", argv, url=f"http://127.0.0.1:{port}")],
            restart_delay=0.1,
            on_restart=restarted.append,
        )
        try:
            await sup.start()
            await sup.wait_ready(timeout=60)
            first = sup.pid("stub-0")
            sup.processes["stub-0"].kill()
            for _ in range(600):
                await asyncio.sleep(0.1)
                if restarted and sup.pid("stub-0") not in (None, first):
                    break
            assert restarted == ["stub-0"]
            await sup.wait_ready(timeout=60)
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        finally:
            await sup.stop()
        assert sup.processes["stub-0"].returncode is not None

    asyncio.run(scenario())


def test_engine_mapping_args_become_json_flags() -> None:
    import json

    spec = EngineSpec(args={"speculative": {"method": "ngram", "num_tokens": 8}})
    cmd = engine_command(spec)
    assert cmd[-2] == "--speculative" and json.loads(cmd[-1]) == {"method": "ngram", "num_tokens": 8}
