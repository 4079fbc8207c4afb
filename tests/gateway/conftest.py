"""Fixtures for the gateway tests: the bench stub as the remote provider and a real gateway on a
loopback port (helpers in gateway_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway

from tokenops.bench.stub import StubConfig, run_stub_in_thread


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, Any]]:
    cfg = StubConfig(models=[MODEL], output_tokens=8)
    url, stop = run_stub_in_thread(cfg)
    yield url, cfg
    stop()


@pytest.fixture(scope="module")
def gateway(stub: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    # one stub behind the model and tests that inject failures on purpose: the replica's breaker must
    # not open between tests (breakers are tested in tests/cluster and test_cluster_cache.py)
    settings = gateway_settings(
        stub[0], tmp_path_factory.mktemp("gw"), cluster={"breaker": {"failure_threshold": 1000}}
    )
    gw = start_gateway(settings)
    yield gw
    gw.stop()
