"""Structured output and tool calls through the gateway, with the official `openai` SDK: a real
gateway in front of a real engine server (the tiny random Llama), so the JSON and the calls that
come back are the engine's grammar-constrained output, passed through unchanged and metered."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema_rs
import openai
import pytest
import sqlalchemy as sa

from tiny_server import ByteTokenizer, start_server
from tokenops.config import load_settings
from tokenops.engine.server import serve_in_thread
from tokenops.gateway.app import create_app

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
ADMIN = "structured-admin-key"
SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["size", "count"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "place_order", "parameters": SCHEMA}}]
MESSAGES = [{"role": "user", "content": "Two small cups."}]


@pytest.fixture(scope="module")
def gateway(tiny_llama, tmp_path_factory):
    data = tmp_path_factory.mktemp("gw-structured")
    _, _, engine_ctx = start_server(
        tiny_llama.model,
        ByteTokenizer(),
        MODEL,
        num_kv_blocks=1024,
        max_model_len=1536,
        max_num_batched_tokens=256,
    )
    with engine_ctx as engine_url:
        settings = load_settings(
            None,
            environ={},
            overrides={
                "host": "127.0.0.1",
                "port": 0,
                "data_dir": data,
                "admin_key": ADMIN,
                "cache": {"enabled": False},
                "models": {MODEL: {"backends": [engine_url + "/v1"], "context_window": 1536}},
            },
        )
        with serve_in_thread(create_app(settings)) as gw_url:
            with httpx.Client(
                base_url=gw_url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
            ) as admin:
                admin.post("/admin/tenants", json={"parent": None, "name": "org"})
                r = admin.post("/admin/keys", json={"node": "org", "name": "agent", "limits": {}})
                assert r.status_code == 201, r.text
            client = openai.OpenAI(
                base_url=gw_url + "/v1", api_key=r.json()["key"], max_retries=0, timeout=60
            )
            yield client, settings.resolved_database_url


def _output_tokens(db_url: str, n: int) -> list[int]:
    engine = sa.create_engine(db_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            with engine.connect() as c:
                rows = [r[0] for r in c.execute(sa.text("SELECT output_tokens FROM ops_ledger"))]
            if len(rows) >= n or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)
    finally:
        engine.dispose()


def test_json_schema_and_tool_calls_pass_through_the_gateway(gateway) -> None:
    client, db_url = gateway
    first = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
    )
    jsonschema_rs.validate(SCHEMA, json.loads(first.choices[0].message.content))
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "place_order"}},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "place_order"
    jsonschema_rs.validate(SCHEMA, json.loads(call.function.arguments))
    # both metered as the engine counted them
    assert sorted(_output_tokens(db_url, 2)) == sorted(
        [first.usage.completion_tokens, r.usage.completion_tokens]
    )


def test_a_call_to_a_missing_function_is_refused_at_the_gateway(gateway) -> None:
    client, _ = gateway
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "refund"}},
        )
    assert exc.value.code == "tool_not_found" and exc.value.param == "tool_choice"


def test_the_responses_api_returns_validated_json_and_calls(gateway) -> None:
    """`/v1/responses` with `text.format` (json_schema) and a forced function: the engine's grammar
    shapes the output items, whole and streamed; a bad schema is a 400 naming the field."""
    client, _ = gateway
    fmt = {"format": {"type": "json_schema", "name": "order", "schema": SCHEMA}}
    r = client.responses.create(
        model=MODEL, input="Two small cups.", max_output_tokens=40, temperature=0, text=fmt
    )
    assert r.status == "completed"
    jsonschema_rs.validate(SCHEMA, json.loads(r.output_text))
    events = list(
        client.responses.create(
            model=MODEL, input="Two small cups.", max_output_tokens=40, temperature=0, text=fmt, stream=True
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and streamed == r.output_text

    tool = {"type": "function", "name": "place_order", "parameters": SCHEMA}
    called = client.responses.create(
        model=MODEL,
        input="Two small cups.",
        max_output_tokens=40,
        temperature=0,
        tools=[tool],
        tool_choice={"type": "function", "name": "place_order"},
    )
    (call,) = [o for o in called.output if o.type == "function_call"]
    assert call.name == "place_order"
    jsonschema_rs.validate(SCHEMA, json.loads(call.arguments))

    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model=MODEL,
            input="x",
            max_output_tokens=4,
            text={"format": {"type": "json_schema", "name": "bad", "schema": {"type": "nope"}}},
        )
    assert exc.value.code == "invalid_json_schema" and exc.value.body["message"]
