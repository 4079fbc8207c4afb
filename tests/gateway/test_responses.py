"""`/v1/responses` through a real gateway with the official `openai` SDK, in front of a stub provider
that speaks OpenAI's chat contract exactly, tool calls included (`message.tool_calls`,
`finish_reason: "tool_calls"`, streamed tool-call deltas). The stub records every body it gets, so
the tests see what the gateway resent of a session's history.

Stored responses are scoped to their tenant; unknown, expired and other tenants' ids are 404s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import sqlalchemy as sa
from gateway_harness import RunningGateway, gateway_settings, start_gateway
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenops.engine.server import serve_in_thread
from tokenops.gateway.compaction import SUMMARY_PREFIX
from tokenops.ops.db import engine_url

MODEL = "agent-model"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_ARGS = '{"city": "Paris"}'
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def agent_stub(seen: list[dict[str, Any]]) -> Starlette:
    """A provider: with tools and no tool result yet it calls get_weather; otherwise it answers text
    that quotes the number of messages it got."""

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        seen.append(body)
        messages = body["messages"]
        calls = bool(body.get("tools")) and messages[-1]["role"] != "tool"
        text = f"answer to {len(messages)} messages"
        prompt = sum(len(str(m.get("content") or "")) // 4 + 4 for m in messages)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 5,
            "total_tokens": prompt + 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        base = {"id": "chatcmpl-1", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": None if calls else text}
            if calls:
                msg["tool_calls"] = [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": CALL_ARGS},
                    }
                ]
            choice = {"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}
            return JSONResponse({**base, "object": "chat.completion", "choices": [choice], "usage": usage})

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        async def events() -> Iterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            if calls:
                yield chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    }
                )
                for piece in ('{"city": ', '"Paris"}'):
                    yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                yield chunk({}, "tool_calls")
            else:
                words = text.split(" ")  # the same text as the whole answer, a word at a time
                for i, word in enumerate(words):
                    yield chunk({"content": word if i == 0 else " " + word})
                yield chunk({}, "stop")
            yield (
                b"data: "
                + orjson.dumps({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
                + b"\n\n"
            )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)]
    )


@pytest.fixture(scope="module")
def seen() -> list[dict[str, Any]]:
    return []


@pytest.fixture(scope="module")
def gw(seen: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with serve_in_thread(agent_stub(seen)) as url:
        settings = gateway_settings(
            url,
            tmp_path_factory.mktemp("gw-responses"),
            models={MODEL: {"backends": [url + "/v1"], "context_window": 4096, "pricing": {"input": 1.0}}},
            cache={"enabled": False},
        )
        gateway = start_gateway(settings)
        yield gateway
        gateway.stop()


@pytest.fixture(scope="module")
def client(gw: RunningGateway) -> openai.OpenAI:
    return gw.client(gw.new_key("agent", org="acme"), timeout=30)


def test_a_response_and_its_follow_up_resend_the_history(
    gw: RunningGateway, client: openai.OpenAI, seen: list[dict[str, Any]]
) -> None:
    first = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.")
    assert first.status == "completed" and first.id.startswith("resp_")
    assert first.output_text == "answer to 2 messages"
    assert seen[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert first.usage.input_tokens > 0 and first.usage.output_tokens == 5

    second = client.responses.create(
        model=MODEL, input="And now?", instructions="Be brief.", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert seen[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "answer to 2 messages"},
        {"role": "user", "content": "And now?"},
    ]
    assert second.output_text == "answer to 4 messages"
    # the same session for the cluster's affinity: the chain's first response
    rows = gw.wait_ledger(2, operation="responses")
    assert [r["session_id"] for r in rows[-2:]] == [first.id, first.id]
    assert all(r["status"] == "ok" and r["uncached_input_tokens"] > 0 for r in rows[-2:])

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text


def test_streamed_events_parse_in_the_sdk(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Stream it", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for needed in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_item.done",
    ):
        assert needed in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == "answer to 1 messages"
    assert final.usage.output_tokens == 5
    # the streamed response was stored and can be continued
    follow = client.responses.create(model=MODEL, input="more", previous_response_id=final.id)
    assert follow.output_text == "answer to 3 messages"


def test_tool_calls_round_trip(client: openai.OpenAI, seen: list[dict[str, Any]]) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
    assert seen[-1]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER_TOOL["parameters"],
                "description": "The weather in a city.",
            },
        }
    ]
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].arguments == CALL_ARGS
    second = client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21C"}],
    )
    sent = seen[-1]["messages"]
    assert sent[-2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": calls[0].call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": CALL_ARGS},
            }
        ],
    }
    assert sent[-1] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21C"}
    assert second.output_text == "answer to 3 messages"


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == CALL_ARGS
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == CALL_ARGS
    final = events[-1]
    assert final.type == "response.completed"
    (call,) = final.response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == "call_1"


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="delete me")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    return exc.response.json()["error"]


def test_unknown_previous_response_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_doesnotexist")
    err = _error(e.value)
    assert err["code"] == "response_not_found" and err["param"] == "previous_response_id"
    assert "resp_doesnotexist" in err["message"] and err["type"] == "invalid_request_error"


def test_another_tenants_response_is_404(gw: RunningGateway, client: openai.OpenAI) -> None:
    mine = client.responses.create(model=MODEL, input="private")
    other = gw.client(gw.new_key("intruder", org="other-org"), timeout=30)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=MODEL, input="hi", previous_response_id=mine.id)
    assert _error(e.value)["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_expired_previous_response_is_404(gw: RunningGateway, client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="short-lived")
    engine = sa.create_engine(engine_url(gw.settings.resolved_database_url))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE ops_responses SET expires_at = created_at WHERE id = :id"), {"id": r.id})
    engine.dispose()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id=r.id)
    assert _error(e.value)["code"] == "response_expired"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": [{"type": "mystery"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": 3}]}, "input[0]"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "bogus": 1}, "bogus"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_clear_400(
    gw: RunningGateway, client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        gw.url + "/v1/responses",
        json={"model": MODEL, **body},
        headers={"authorization": f"Bearer {client.api_key}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input="x")
    assert _error(e.value)["code"] == "model_not_found"


def test_every_response_is_metered(gw: RunningGateway, client: openai.OpenAI) -> None:
    before = len(gw.ledger(operation="responses"))
    client.responses.create(model=MODEL, input="count me")
    deadline = time.monotonic() + 10
    while len(gw.ledger(operation="responses")) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(gw.ledger(operation="responses")) == before + 1


def test_a_repeated_deterministic_response_is_a_cache_hit(gateway: RunningGateway) -> None:
    """The default gateway (response cache on) in front of the bench stub: the Responses path takes
    the chat path's cache, whole and streamed."""
    client = gateway.client(gateway.new_key("responses-cache", org="cache-org"), timeout=30)
    ask = {"model": "stub-model", "input": "What is two plus two?", "temperature": 0, "store": False}
    first = client.responses.with_raw_response.create(**ask)
    assert first.headers["x-tokenops-cache"] == "miss"
    # the answer is stored after the client has it: a repeat may come first, and miss
    asked = 1
    for _ in range(50):
        again = client.responses.with_raw_response.create(**ask)
        asked += 1
        if again.headers["x-tokenops-cache"] == "hit-exact":
            break
        time.sleep(0.1)
    assert again.headers["x-tokenops-cache"] == "hit-exact"
    assert again.parse().output_text == first.parse().output_text
    events = list(client.responses.create(**ask, stream=True))
    asked += 1
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == first.parse().output_text
    # every request, missed repeats included, leaves one row; the rows of the last two may land in
    # either order (each is written after its answer), so wait for all of them, then compare as sets
    rows = gateway.wait_ledger(asked, tenant="cache-org")
    assert len(rows) == asked
    assert rows[0]["status"] == "ok"
    assert sorted(r["status"] for r in rows[-2:]) == ["cache_hit", "cache_hit"]
    assert {r["operation"] for r in rows} == {"responses"}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_gw(
    request: pytest.FixtureRequest, seen: list[dict[str, Any]], tmp_path: Any
) -> Iterator[RunningGateway]:
    """A gateway before the agent stub on each database (PostgreSQL in a schema of its own)."""
    database: dict[str, Any] = {}
    if request.param == "postgresql":
        schema = f"t_responses_{uuid.uuid4().hex[:12]}"
        database = {"database_url": PG_URL, "database_schema": schema}
    with serve_in_thread(agent_stub(seen)) as url:
        settings = gateway_settings(
            url,
            tmp_path,
            models={MODEL: {"backends": [url + "/v1"], "context_window": 4096, "pricing": {"input": 1.0}}},
            cache={"enabled": False},
            **database,
        )
        gateway = start_gateway(settings)
        try:
            yield gateway
        finally:
            gateway.stop()
            if database:
                engine = sa.create_engine(engine_url(PG_URL))
                with engine.begin() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{database["database_schema"]}" CASCADE'))
                engine.dispose()


def _session(client: openai.OpenAI, rounds: int) -> list[str]:
    """A session of long turns far below the window; the ids of its responses."""
    ids: list[str] = []
    for k in range(rounds):
        r = client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=f"round {k}: " + "facts " * 60,
            previous_response_id=ids[-1] if ids else None,
        )
        ids.append(r.id)
    return ids


def test_a_tenant_history_budget_compacts_its_sessions(
    db_gw: RunningGateway, seen: list[dict[str, Any]]
) -> None:
    """`max_history_tokens` on a tenant node (admin API) compacts that tenant's sessions well inside
    the window; the smallest budget on the key's path applies; other tenants are untouched."""
    gw = db_gw
    assert gw.admin("POST", "/admin/tenants", json={"parent": None, "name": "lean"}).status_code == 201
    r = gw.admin("PATCH", "/admin/tenants/lean", json={"limits": {"max_history_tokens": 300}})
    assert r.status_code == 200 and r.json()["settings"]["max_history_tokens"] == 300
    # the project cannot loosen its organisation's budget
    roomier = {"parent": "lean", "name": "proj", "limits": {"max_history_tokens": 9000}}
    assert gw.admin("POST", "/admin/tenants", json=roomier).status_code == 201
    lean = gw.client(gw.new_key("agent", org="lean"), timeout=30)
    roomy = gw.client(gw.new_key("agent", org="roomy"), timeout=30)

    _session(roomy, 5)
    assert not gw.ledger(operation="compaction", tenant="roomy")
    assert not any(m["content"].startswith(SUMMARY_PREFIX) for m in seen[-1]["messages"][1:])

    ids = _session(lean, 5)
    compactions = gw.wait_ledger(1, operation="compaction", tenant="lean")
    assert compactions and all(c["status"] == "ok" for c in compactions)
    sent = seen[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "Be brief."}
    assert sent[1]["content"].startswith(SUMMARY_PREFIX)  # the older turns, summarised
    assert sent[-1]["content"].startswith("round 4:")  # the new turn as it was sent
    # every round's prompt stayed near the tenant's budget, though the session is longer
    rows = gw.wait_ledger(5, operation="responses", tenant="lean")
    assert max(r["uncached_input_tokens"] for r in rows) < 300 + 120
    assert lean.responses.retrieve(ids[-1]).id == ids[-1]

    # cleared on the organisation, the project's own budget applies (the key cache is forgotten)
    r = gw.admin("PATCH", "/admin/tenants/lean", json={"limits": {"max_history_tokens": None}})
    assert r.status_code == 200 and r.json()["settings"]["max_history_tokens"] is None
    before = len(gw.ledger(operation="compaction", tenant="lean"))
    _session(lean, 5)
    assert len(gw.ledger(operation="compaction", tenant="lean")) == before

    bad = gw.admin("PATCH", "/admin/tenants/lean", json={"limits": {"max_history_tokens": 10}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_history_tokens"
