"""P/D over two real vLLM servers (CPU build) through the cluster's PD dispatch, with the KV connector
vLLM 0.32's CPU build can run without a GPU transport: ExampleConnector, which writes each prompt's KV
per layer to a shared folder and loads it on the server that next sees the same prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from conftest import BLOCK, SERVED, vllm_pair
from tokenops.bench.vllm_process import VLLMServer
from tokenops.cluster import ClusterConfig, DispatchRequest, RequestInfo, build_cluster
from tokenops.config import load_settings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

PROMPT = (
    "The lighthouse museum keeps the logbooks of every keeper since the tower was lit. Each page notes "
    "the weather, the ships that passed and the oil burned that night. "
) * 4


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, VLLMServer, Path]]:
    store = tmp_path_factory.mktemp("vllm-kv-store")
    logs = tmp_path_factory.mktemp("vllm-pd-logs")
    config = json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    )
    kv = ["--kv-transfer-config", config]
    with vllm_pair(logs, "vllm-pd", 2048, extra_args=kv) as servers:
        yield servers[0], servers[1], store


@pytest.mark.anyio
async def test_the_decode_server_loads_the_prefill_servers_kv_through_the_pd_dispatch(pd_pair) -> None:
    prefill, decode, store = pd_pair
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    pd = {"policy": "static_pd", "prefill": [prefill.url + "/v1"], "decode": [decode.url + "/v1"]}
    settings = load_settings(None, environ={}, overrides={"models": {SERVED: {"pd": pd}}})
    cluster = build_cluster(settings.models, ClusterConfig())
    try:
        info = RequestInfo(SERVED, prompt_tokens=len(PROMPT) // 4, max_tokens=8)
        async with cluster.open(DispatchRequest(info, "/completions", body)) as up:
            answer = orjson.loads(await up.read())
    finally:
        await cluster.aclose()
    assert up.pd.decision.remote and [leg["kind"] for leg in up.pd.legs] == ["prefill"]
    assert up.pd.legs[0]["status"] == 200, up.pd.legs
    assert any(store.rglob("*.safetensors")), "the prefill server stored no KV"
    usage = answer["usage"]
    # the decode server never saw the prompt: its full blocks came from the prefill server's KV
    assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK * ((usage["prompt_tokens"] - 1) // BLOCK)
    # and it decodes what a server that computed the whole prompt itself decodes
    alone = httpx.post(prefill.url + "/v1/completions", json=body, timeout=300).json()
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
