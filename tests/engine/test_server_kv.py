"""The OpenAI-compatible server over an engine with int4 weights, an int8 KV cache and KV eviction:
a prompt longer than the whole KV pool is served through the official `openai` client, and
`/v1/load` and `/metrics` report the KV dtype, bytes per token and evicted blocks."""

from __future__ import annotations

import copy

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tiny_server import ByteTokenizer, start_server
from tokenops.engine.quantize import Int4WeightOnlyLinear

MODEL = "tiny-kv"


def test_prompt_longer_than_the_pool_is_served_with_eviction_and_reported(tiny_llama):
    engine, _, ctx = start_server(
        copy.deepcopy(tiny_llama.model),
        ByteTokenizer(),
        MODEL,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        max_model_len=512,
        quantization="int4",
        kv_cache_dtype="int8",
        kv_eviction={"sink_tokens": 4, "window_tokens": 32},
    )
    assert any(isinstance(m, Int4WeightOnlyLinear) for m in engine.model.modules())
    prompt = "the tide comes in and the tide goes out " * 6  # 240 byte tokens; the pool holds 96
    with ctx as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens >= 240 and out.usage.completion_tokens == 40
        with httpx.Client(base_url=url, timeout=60) as http:
            load = http.get("/v1/load").json()
            families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert load["kv_cache_dtype"] == "int8"
    assert load["kv_bytes_per_token"] == engine.kv_bytes_per_token == 2 * 2 * 2 * (16 + 2)
    assert load["kv_evicted_blocks"] >= (240 + 40 - 4 - 32 - 4 - 16) // 4
    assert families["tokenops_engine_kv_bytes_per_token"].samples[0].value == load["kv_bytes_per_token"]
    evicted = families["tokenops_engine_kv_evicted_blocks"].samples[0].value
    assert evicted == load["kv_evicted_blocks"]
