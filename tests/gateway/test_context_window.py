"""The configured context window is enforced at admission for every backend: a request whose prompt
plus max_tokens cannot fit is a 400 `context_length_exceeded`, as the engine gives, and never reaches
the backend (the harness's model has a 4,096-token window)."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import MODEL, RunningGateway


@pytest.fixture(scope="module")
def key(gateway: RunningGateway) -> str:
    return gateway.new_key("window")


def _stub_requests(stub) -> int:
    return httpx.get(stub[0] + "/stub/stats").json()["requests"]


def _post(gateway: RunningGateway, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 8000}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 3000},
            "messages",
        ),
        ("/v1/completions", {"prompt": list(range(4000)), "max_tokens": 100}, "prompt"),
        ("/v1/completions", {"prompt": ["short", "word " * 8000], "max_tokens": 10}, "prompt"),
    ],
    ids=[
        "max_tokens",
        "max_tokens_at_window",
        "prompt",
        "prompt_plus_max_tokens",
        "token_ids",
        "one_of_prompts",
    ],
)
def test_a_request_over_the_window_is_refused_before_the_backend(
    gateway: RunningGateway, stub, key: str, path: str, body: dict, param: str
) -> None:
    before = _stub_requests(stub)
    r = _post(gateway, key, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert "maximum context length is 4096 tokens" in err["message"]
    assert _stub_requests(stub) == before  # never forwarded


def test_a_request_that_may_fit_is_forwarded(gateway: RunningGateway, key: str) -> None:
    # 12,000 bytes may be 3,000 tokens or fewer: the backend decides with the real count
    r = _post(
        gateway,
        key,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2400}], "max_tokens": 500},
    )
    assert r.status_code == 200, r.text
    r = _post(
        gateway, key, "/v1/completions", {"model": MODEL, "prompt": list(range(4000)), "max_tokens": 96}
    )
    assert r.status_code == 200, r.text
