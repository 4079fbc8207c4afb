"""End to end through a real gateway in front of the bench stub, with the official `openai` SDK."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import orjson
import pytest
from gateway_harness import MODEL, RunningGateway

MSG = [{"role": "user", "content": "say something"}]


def test_chat_completion_and_ledger_row(gateway: RunningGateway) -> None:
    key = gateway.new_key("chat")
    client = gateway.client(key)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=5)
    out = raw.parse()
    assert out.choices[0].message.content.split() and out.usage.completion_tokens == 5
    assert raw.headers["x-request-id"].startswith("req-") and raw.headers["x-tokenops-model"] == MODEL
    key_id = next(k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "chat")
    (row,) = gateway.wait_ledger(1, key_id=key_id)
    assert row["status"] == "ok" and row["output_tokens"] == 5 and row["finish_reason"] == "length"
    assert row["uncached_input_tokens"] + row["cached_input_tokens"] == out.usage.prompt_tokens
    # 1 and 2 units per million tokens: one micro-unit per input token, two per output token
    assert row["cost_micros"] == row["uncached_input_tokens"] + row["cached_input_tokens"] + 2 * 5


def test_streaming_usage_only_when_asked(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("stream"))
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    # not asked: the gateway still asks the backend for usage (it meters), but strips that chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_text_completion_and_models(gateway: RunningGateway) -> None:
    client = gateway.client(gateway.new_key("cmpl"))
    out = client.completions.create(model=MODEL, prompt="one two three", max_tokens=3)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 3
    streamed = list(client.completions.create(model=MODEL, prompt="a b", max_tokens=4, stream=True))
    assert sum(1 for c in streamed if c.choices and c.choices[0].text) == 4
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    return body["error"]


def test_errors_are_openai_shaped(gateway: RunningGateway) -> None:
    key = gateway.new_key("errors")
    h = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        r = http.post("/v1/chat/completions", content=b"{nope", headers=h)
        assert r.status_code == 400 and _error(r)["code"] == "invalid_json"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, headers=h)
        assert r.status_code == 400 and _error(r)["param"] == "messages"
        r = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": "x"}, headers=h
        )
        assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 70_000}, headers=h)
        assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
        r = http.get("/v1/nothing-here", headers=h)
        assert r.status_code == 404 and _error(r)["code"] == "unknown_url"
        r = http.get("/v1/chat/completions", headers=h)
        assert r.status_code == 405
    client = gateway.client(key)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=MSG)
    assert e.value.code == "model_not_found" and MODEL in e.value.message
    with pytest.raises(openai.AuthenticationError):
        gateway.client("tok-not-a-key").chat.completions.create(model=MODEL, messages=MSG)
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"


def test_revoked_key_and_model_not_allowed(gateway: RunningGateway) -> None:
    key = gateway.new_key("revoke-me")
    client = gateway.client(key)
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "revoke-me"
    )
    assert gateway.admin("DELETE", f"/admin/keys/{key_id}").status_code == 200
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    assert key not in e.value.message
    narrow = gateway.client(gateway.new_key("narrow", {"allowed_models": ["other-model"]}))
    with pytest.raises(openai.PermissionDeniedError):
        narrow.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)


def test_admin_requires_the_admin_key(gateway: RunningGateway) -> None:
    with httpx.Client(base_url=gateway.url) as http:
        assert http.get("/admin/keys").status_code == 401
        assert http.get("/admin/keys", headers={"authorization": "Bearer wrong"}).status_code == 401
    r = gateway.admin("GET", "/admin/usage", params={"group_by": "tenant,model"})
    assert r.status_code == 200 and isinstance(r.json()["data"], list)
    assert gateway.admin("GET", "/admin/usage", params={"group_by": "colour"}).status_code == 400


def test_killed_client_mid_stream_is_billed_for_what_was_produced(gateway: RunningGateway, stub) -> None:
    key = gateway.new_key("killed")
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "killed"
    )
    host, port = gateway.url.removeprefix("http://").split(":")
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "go on"}],
        }
    )
    req = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    stub[1].itl_s = 0.02
    try:
        sock = socket.create_connection((host, int(port)))
        sock.sendall(req)
        received = b""
        while received.count(b'"content"') < 6:  # a few tokens arrive, then the client dies
            received += sock.recv(65536)
        sock.close()
    finally:
        stub[1].itl_s = 0.0
    (row,) = gateway.wait_ledger(1, key_id=key_id)
    assert row["status"] == "client_disconnected"
    assert 5 <= row["output_tokens"] < 200 and row["uncached_input_tokens"] > 0 and row["cost_micros"] > 0


def test_backend_failure_before_any_token_is_not_billed(gateway: RunningGateway, stub) -> None:
    key = gateway.new_key("failing")
    key_id = next(
        k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "failing"
    )
    client = gateway.client(key)
    stub[1].fail_status, stub[1].fail_count = 500, 1
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, stream=True)
    assert e.value.status_code == 502 and e.value.code == "upstream_failed"  # the cluster tried every replica
    stub[1].drop_after = 3
    try:
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, stream=True))
        with pytest.raises(openai.APIStatusError) as e:  # a whole answer cut off: 502, not billed
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10)
        assert e.value.status_code == 502
    finally:
        stub[1].drop_after = None
    rows = gateway.wait_ledger(3, key_id=key_id)
    assert [r["status"] for r in rows] == ["upstream_error"] * 3
    assert rows[0]["cost_micros"] == 0 and rows[0]["output_tokens"] == 0
    assert rows[1]["output_tokens"] == 3  # the dropped stream is billed for the tokens relayed
    assert rows[2]["cost_micros"] == 0


def test_budget_cuts_the_stream_with_a_final_error(gateway: RunningGateway) -> None:
    # 1 micro-unit per input token, 2 per output token: 400 micro-units leave room for a short answer only
    key = gateway.new_key("tight", {"budget_micros": 400, "budget_period": "total"}, org="budget-org")
    client = gateway.client(key)
    got: list[str] = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1000, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert "budget" in str(e.value).lower()
    assert 0 < len(got) < 1000
    key_id = next(k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == "tight")
    (row,) = gateway.wait_ledger(1, key_id=key_id)
    assert row["status"] == "budget_exhausted" and row["cost_micros"] <= 400


def test_metrics_exposed(gateway: RunningGateway) -> None:
    gateway.client(gateway.new_key("metrics")).chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=2
    )
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(gateway.url + "/metrics").text
        if (
            'tokenops_tokens_total{model="stub-model",tenant="org",type="output"}' in text
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)
    for name in (
        "tokenops_requests_total",
        "tokenops_tokens_total",
        "tokenops_cost_micros_total",
        "tokenops_ttft_seconds",
        "tokenops_e2e_seconds",
        "tokenops_refusals_total",
    ):
        assert name in text
