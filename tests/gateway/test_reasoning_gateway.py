"""Reasoning budgets through the gateway, with the official `openai` SDK: a real gateway in front of a
real engine server running the tiny thinking Llama (tests/conftest.py, which never closes its
thinking by itself, so the budget the engine gets is the reasoning it reports).

The tenant tree's `max_reasoning_tokens` is the default when a request gives none and caps a
request that asks for more; the engine's usage meters reasoning tokens into the ledger's reasoning
column, billed at the model's reasoning price.
"""

from __future__ import annotations

import math

import openai
import pytest
from gateway_harness import gateway_settings, start_gateway

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.reasoning import ReasoningMarkers
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

pytestmark = pytest.mark.timeout(300)

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
PRICE = {"input": 1.0, "output": 2.0, "reasoning": 5.0}


@pytest.fixture(scope="module")
def engine_url(thinker):
    loaded = thinker("r1")
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)
    )
    config = ServerConfig(
        served_model_names=[MODEL],
        max_model_len=engine.max_model_len,
        reasoning_markers=ReasoningMarkers.parse(loaded.tokenizer, "auto"),
    )
    with serve_in_thread(build_app(engine, loaded.tokenizer, config)) as url:
        yield url


@pytest.fixture(scope="module")
def gw(engine_url, tmp_path_factory):
    settings = gateway_settings(
        engine_url,
        tmp_path_factory.mktemp("gw-reasoning"),
        models={
            MODEL: {
                "backends": [engine_url + "/v1"],
                "context_window": 1024,
                "reasoning_budget_field": "max_reasoning_tokens",
                "pricing": PRICE,
            }
        },
        cache={"enabled": False},
    )
    gateway = start_gateway(settings)
    # org "capped" lets its requests think 4 tokens at most; org "open" sets no cap
    gateway.admin(
        "POST",
        "/admin/tenants",
        json={"parent": None, "name": "capped", "limits": {"max_reasoning_tokens": 4}},
    )
    yield gateway
    gateway.stop()


def chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=extra or None
    )


def reasoning_of(response) -> int:
    return response.usage.completion_tokens_details.reasoning_tokens


def test_tenant_cap_is_the_default_and_the_ceiling(gw):
    client = gw.client(gw.new_key("k1", org="capped", project="p"))
    assert reasoning_of(chat(client)) == 4  # no budget asked: the tenant's
    assert reasoning_of(chat(client, max_reasoning_tokens=2)) == 2  # a request may lower it
    assert reasoning_of(chat(client, max_reasoning_tokens=50)) == 4  # not raise it
    assert reasoning_of(chat(client, reasoning_effort="high")) == 4  # nor think longer by effort


def test_a_key_node_lowers_its_tenants_cap(gw):
    client = gw.client(gw.new_key("k0", {"max_reasoning_tokens": 0}, org="capped", project="p"))
    r = chat(client)
    assert reasoning_of(r) == 0 and (r.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_without_a_cap_the_request_decides(gw):
    client = gw.client(gw.new_key("k2", org="open", project="p"))
    assert reasoning_of(chat(client, max_reasoning_tokens=3)) == 3
    assert reasoning_of(chat(client)) == 16  # no budget anywhere: it thinks up to max_tokens


def test_reasoning_is_metered_and_billed_at_the_reasoning_price(gw):
    key = gw.new_key("k3", org="capped", project="p")
    r = chat(gw.client(key))
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") and msg.content
    row = gw.wait_ledger(1, key_id=_key_id(gw, "capped/p/k3"))[0]
    assert row["reasoning_tokens"] == 4
    assert row["output_tokens"] == r.usage.completion_tokens - 4
    assert row["uncached_input_tokens"] + row["cached_input_tokens"] == r.usage.prompt_tokens
    expected = (
        r.usage.prompt_tokens * PRICE["input"]
        + row["output_tokens"] * PRICE["output"]
        + 4 * PRICE["reasoning"]
    )
    assert row["cost_micros"] == math.ceil(expected)


def test_streamed_reasoning_through_the_gateway(gw):
    key = gw.new_key("k4", org="capped", project="p")
    stream = gw.client(key).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_reasoning_tokens": 3},
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert usage.completion_tokens_details.reasoning_tokens == 3
    whole = chat(gw.client(key), max_reasoning_tokens=3).choices[0].message
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content
    rows = gw.wait_ledger(2, key_id=_key_id(gw, "capped/p/k4"))
    assert [r["reasoning_tokens"] for r in rows] == [3, 3]


def test_bad_budget_is_refused_before_admission(gw):
    client = gw.client(gw.new_key("k5", org="open", project="p"))
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_reasoning_tokens=-2)
    assert e.value.body["param"] == "max_reasoning_tokens"


def _key_id(gw, node_path: str) -> str:
    keys = gw.admin("GET", "/admin/keys").json()["data"]
    return next(k["id"] for k in keys if k["node_path"] == node_path)


def test_cap_goes_under_the_backends_field_name_or_nowhere():
    import orjson

    from tokenops.gateway.request import parse_request

    def inbound(**extra):
        body = {"model": MODEL, "messages": MESSAGES, **extra}
        return parse_request("chat", orjson.dumps(body), None)

    req = inbound(max_reasoning_tokens=900)
    assert req.cap_reasoning(256, "thinking_budget") == 256
    sent = orjson.loads(req.upstream_body("served", None))
    assert sent["thinking_budget"] == 256 and "max_reasoning_tokens" not in sent
    # a backend that takes no budget gets the body as the client sent it
    req = inbound(max_reasoning_tokens=900)
    assert req.cap_reasoning(256, None) is None
    assert orjson.loads(req.upstream_body("served", None))["max_reasoning_tokens"] == 900
    # no cap and no request budget: nothing is added
    req = inbound()
    assert req.cap_reasoning(None, "max_reasoning_tokens") is None
    assert "max_reasoning_tokens" not in orjson.loads(req.upstream_body("served", None))
