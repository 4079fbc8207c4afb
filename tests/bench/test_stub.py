"""The stub upstream, driven by the official OpenAI SDK and raw httpx over real loopback HTTP."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tokenops.bench.stub import StubConfig, run_stub_in_thread


@pytest.fixture(scope="module")
def stub():
    cfg = StubConfig(output_tokens=5, models=["stub", "other"])
    url, stop = run_stub_in_thread(cfg)
    yield url, cfg
    stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_models_and_health(stub):
    url, _ = stub
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert [m.id for m in _client(url).models.list()] == ["stub", "other"]


def test_chat_non_streaming_counts(stub):
    url, _ = stub
    r = _client(url).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "one two three"}]
    )
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == 3
    assert len(r.choices[0].message.content.split()) == 5
    assert r.model == "anything"
    r = _client(url).chat.completions.create(
        model="stub", messages=[{"role": "user", "content": "a"}], max_tokens=2
    )
    assert r.usage.completion_tokens == 2
    assert r.choices[0].finish_reason == "length"


def test_chat_streaming_with_usage(stub):
    url, _ = stub
    stream = _client(url).chat.completions.create(
        model="stub",
        messages=[{"role": "user", "content": "x " * 40}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            content.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(content) == 7
    assert usage.completion_tokens == 7 and usage.prompt_tokens == 40
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_prefix_cache_reports_cached_tokens():
    url, stop = run_stub_in_thread(block_size=4)
    try:
        c = _client(url)
        prompt = " ".join(f"w{i}" for i in range(10))
        first = c.completions.create(model="stub", prompt=prompt, max_tokens=1)
        again = c.completions.create(model="stub", prompt=prompt + " tail", max_tokens=1)
        other = c.completions.create(model="stub", prompt="z " + prompt, max_tokens=1)
    finally:
        stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 8  # two whole 4-word blocks
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_streaming(stub):
    url, _ = stub
    texts = [
        c.choices[0].text
        for c in _client(url).completions.create(model="stub", prompt="hi", max_tokens=3, stream=True)
        if c.choices and c.choices[0].text
    ]
    assert len(texts) == 3


def test_pace_is_respected():
    url, stop = run_stub_in_thread(ttft_s=0.05, itl_s=0.02, output_tokens=4)
    try:
        t0 = time.perf_counter()
        times = []
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True},
        ) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    times.append(time.perf_counter() - t0)
    finally:
        stop()
    assert len(times) == 4
    assert times[0] >= 0.05
    # a late read can merge two chunks, so bound the last token, not each gap
    assert times[-1] >= 0.05 + 3 * 0.02


def test_fault_status_and_count(stub):
    url, cfg = stub
    cfg.fail_status, cfg.fail_count = 503, 1
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            _client(url).chat.completions.create(model="s", messages=[{"role": "user", "content": "q"}])
        assert exc.value.status_code == 503
        assert exc.value.body["code"] == "stub_failure"
        ok = _client(url).chat.completions.create(model="s", messages=[{"role": "user", "content": "q"}])
        assert ok.usage.completion_tokens == 5
    finally:
        cfg.fail_status, cfg.fail_count = None, None
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "s", "messages": [{"role": "user", "content": "q"}]},
        headers={"x-stub-fail-status": "429"},
    )
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_mid_stream_drop(stub):
    url, _ = stub
    got = []
    with pytest.raises(httpx.HTTPError):
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={
                "model": "s",
                "messages": [{"role": "user", "content": "q"}],
                "stream": True,
                "max_tokens": 10,
            },
            headers={"x-stub-drop-after": "3", "x-stub-itl-ms": "1"},
        ) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    got.append(line)
    assert len(got) == 3
    stats = httpx.get(url + "/stub/stats").json()
    assert stats["dropped"] >= 1 and stats["in_flight"] == 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user", "content": "q"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
    ],
)
def test_bad_input_is_openai_error(stub, body, param):
    url, _ = stub
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_scripted_replies_are_answered_in_order_then_the_reply():
    cfg = StubConfig(reply="fallback answer", replies=["first", "second one"])
    url, stop = run_stub_in_thread(cfg)
    try:
        client = _client(url)
        texts = [
            client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "q"}])
            .choices[0]
            .message.content.strip()
            for _ in range(3)
        ]
    finally:
        stop()
    assert texts == ["first", "second one", "fallback answer"] and cfg.replies == []
    with pytest.raises(ValueError, match="at least one word"):
        StubConfig(replies=["ok", "  "])
