"""Strict request validation through the running gateway: a value of the wrong JSON type (a boolean
for an integer, a string for a boolean) or a malformed logit_bias, content part, tool or
response_format, a tool_choice naming a function not in tools, or a JSON schema that is invalid or
that constrained decoding cannot enforce is a 400 naming the field, never forwarded."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import MODEL, RunningGateway

MSG = [{"role": "user", "content": "hi"}]

BAD = [
    ({"max_tokens": True}, "max_tokens", "not a boolean"),
    ({"max_tokens": 5.0}, "max_tokens", "not a number"),
    ({"stream": "yes"}, "stream", "not a string"),
    ({"n": True}, "n", "not a boolean"),
    ({"temperature": "0"}, "temperature", "not a string"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "not an integer"),
    ({"logit_bias": {"abc": "x"}}, "logit_bias.abc", "not a string"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"50256": 101}}, "logit_bias", "[-100, 100]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}, {"foo": 1}]}]},
        "messages.0.content",
        "image_url",
    ),
    ({"messages": [{"role": "user", "content": [{"foo": 1}]}]}, "messages.0.content", "type"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "messages.0.content",
        "'text' as a string",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "not an integer"),
    ({"tools": [{"type": "function"}]}, "tools", "name"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"logprobs": "true"}, "logprobs", "not a string"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "lookup"}}],
            "tool_choice": {"type": "function", "function": {"name": "refund"}},
        },
        "tool_choice",
        "not in tools",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}},
        "response_format.json_schema.schema",
        "not a valid JSON Schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}}},
        "response_format.json_schema.schema",
        "cannot enforce",
    ),
]


@pytest.fixture(scope="module")
def key(gateway: RunningGateway) -> str:
    return gateway.new_key("strict")


@pytest.mark.parametrize(
    ("patch", "param", "says"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)]
)
def test_a_wrongly_typed_field_is_a_400_naming_it(
    gateway: RunningGateway, key: str, patch: dict, param: str, says: str
) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, **patch}
    r = httpx.post(
        gateway.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_a_text_completion_is_as_strict(gateway: RunningGateway, key: str) -> None:
    for patch, param in (
        ({"echo": 1}, "echo"),
        ({"max_tokens": False}, "max_tokens"),
        ({"logit_bias": []}, "logit_bias"),
    ):
        r = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **patch},
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_well_typed_requests_still_pass(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("strict-ok"))
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        max_tokens=4,
        temperature=1,  # an integer where a number is asked is a number
        logit_bias={"50256": -100},
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        response_format={"type": "text"},
    )
    assert r.choices[0].message.content
