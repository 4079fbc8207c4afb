"""Two real vLLM servers (CPU build, from .venv-vllm) for the whole session, and a real gateway in front.

vLLM takes a while to start (minutes when it compiles the model, which the tests skip with
`--optimization-level 0`), so both replicas start once, side by side, one core each, and every test
reuses them; tests leave them as they found them (no request running). Each
publishes its KV events over ZeroMQ and runs with block size 32, the gateway's prefix hashing block.
Skipped, with the reason, where `make vllm-env` has not been run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tokenops.bench.vllm_process import VLLMServer, vllm_missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))

from gateway_harness import RunningGateway, start_gateway  # noqa: E402

from tokenops.config import load_settings  # noqa: E402

MODEL = "smol"  # the gateway's name; vLLM serves it as smollm2-135m-instruct
SERVED = "smollm2-135m-instruct"
ADMIN_KEY = "test-admin-key"
BLOCK = 32  # vLLM's --block-size: its CPU attention takes multiples of 32


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = vllm_missing()
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"vLLM not available: {reason}"))
    # the P/D pair first: its servers stop before the session's pair starts, so at most two vLLM
    # servers (about 5 GB) run at once
    items.sort(key=lambda item: Path(item.fspath).name != "test_vllm_pd.py")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def vllm_pair(logs: Path, name: str, max_model_len: int, **options: Any) -> Iterator[list[VLLMServer]]:
    """Two vLLM servers of the bundled model, one core each, block size BLOCK, eager (the tests measure
    no speed, and compiling takes minutes per server); started side by side, stopped on exit.
    `options` are further VLLMServer fields; `extra_args` come after the eager flag."""
    extra = ["--optimization-level", "0", *options.pop("extra_args", [])]
    servers = [
        VLLMServer(
            served_name=SERVED,
            threads=1,
            cores=str(i),
            kv_cache_gib=1,
            max_model_len=max_model_len,
            block_size=BLOCK,
            log_path=logs / f"{name}-{i}.log",
            extra_args=extra,
            **options,
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="session")
def vllm_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMServer]]:
    with vllm_pair(tmp_path_factory.mktemp("vllm-logs"), "vllm", 4096, kv_events=True) as servers:
        yield servers


@pytest.fixture(scope="session")
def gateway(
    vllm_replicas: list[VLLMServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    urls = [s.url + "/v1" for s in vllm_replicas]
    settings = load_settings(
        None,
        environ={},
        overrides={
            "host": "127.0.0.1",
            "port": 0,
            "data_dir": tmp_path_factory.mktemp("gw"),
            "admin_key": ADMIN_KEY,
            "models": {
                MODEL: {
                    "backends": urls,
                    "served_name": SERVED,
                    "tokenizer": SERVED,  # the bundled model vLLM's HF folder was written from
                    "context_window": 4096,
                    "pricing": {"input": 1.0, "cached_input": 0.5, "output": 2.0},
                }
            },
            "cluster": {
                "models": {
                    MODEL: {
                        "policy": "prefix_aware",
                        "kinds": dict.fromkeys(urls, "vllm"),
                        "kv_events": {
                            u: {"endpoint": s.events_endpoint, "replay_endpoint": s.replay_endpoint}
                            for u, s in zip(urls, vllm_replicas, strict=True)
                        },
                        "block_size": BLOCK,
                    }
                },
                "load_poll_interval_s": 0.2,
                "breaker": {"failure_threshold": 1000},
            },
        },
    )
    gw = start_gateway(settings)
    tokenizer = gw.app.cluster.pools[MODEL].prompt_tokenizer
    assert tokenizer is not None and tokenizer.wait(120), tokenizer.error
    yield gw
    gw.stop()
