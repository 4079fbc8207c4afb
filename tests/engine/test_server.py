"""The engine's OpenAI-compatible server, end to end: a real uvicorn server on a loopback port,
the real engine on the tiny random Llama (conftest), and the official `openai` SDK as the client.

The tiny model has 256 token ids, so the test tokenizer is byte-level (tests/tiny_server.py).
A random model emits random bytes, which exercises the detokenizer's UTF-8 handling for free.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tiny_server import ByteTokenizer, start_server
from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

MODEL = "tiny-llama"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine, app, ctx = start_server(tiny_llama.model, ByteTokenizer(), MODEL)
    with ctx as url:
        yield SimpleNamespace(url=url, engine=engine, app_server=app.state.server)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = http.get("/v1/load").json()
        if load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_used"] == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"engine did not go idle: {load}")
        time.sleep(0.05)


MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def test_chat_stream_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    # usage comes once, in a last chunk without choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_batch(client: openai.OpenAI) -> None:
    prompts = ["The quick brown fox", "Once upon a time"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
    assert [c.index for c in full.choices] == [0, 1]
    for i, p in enumerate(prompts):
        single = client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
        assert single.choices[0].text == full.choices[i].text  # same tokens alone or in a batch
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True
            )
        )
        assert streamed == single.choices[0].text
    # prompts given as token ids are accepted too
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_n_choices_with_seed(client: openai.OpenAI) -> None:
    a = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=7, n=3)
    b = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # each choice has its own seed
    assert a.usage.prompt_tokens == len(b"Hello") + 0  # the prompt is counted once
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1]  # greedy: both choices agree


def test_repeated_long_prompt_is_served_from_the_prefix_cache(client: openai.OpenAI) -> None:
    prompt = "A long shared preamble that fills several KV blocks. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == len(prompt.encode())
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
    assert second.choices[0].text == first.choices[0].text
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, temperature=0)
    again = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in again if c.usage][0]
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL, prompt="Stop test:", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    # a stop string taken from the middle of the greedy output (clean characters only)
    stop = next(
        text[i : i + 2]
        for i in range(len(text) // 3, len(text) - 2)
        if text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2]
    )
    expected = text[: text.index(stop)]
    cut = client.completions.create(
        model=MODEL,
        prompt="Stop test:",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
        stop=[stop],
    )
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < base.usage.completion_tokens
    streamed = client.completions.create(
        model=MODEL,
        prompt="Stop test:",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
        stop=stop,
        stream=True,
    )
    parts, reasons = [], []
    for c in streamed:
        parts.append(c.choices[0].text)
        reasons.append(c.choices[0].finish_reason)
    assert "".join(parts) == expected
    assert reasons[-1] == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    # streamed: each token's logprobs arrive once, in order
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_idle_engine_thread_sleeps(server, http: httpx.Client) -> None:
    _wait_idle(http)
    thread = server.app_server.engine._thread
    stat = f"/proc/self/task/{thread.native_id}/stat"
    try:
        open(stat).close()
    except OSError:
        pytest.skip("needs Linux /proc")

    def cpu_ticks() -> int:
        fields = open(stat).read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    steps, before = server.app_server.engine.steps, cpu_ticks()
    time.sleep(0.5)
    assert server.app_server.engine.steps == steps  # no engine steps without work
    assert cpu_ticks() - before <= 2  # blocked on its inbox, not spinning


def test_client_disconnect_aborts_and_frees_blocks(server, http: httpx.Client) -> None:
    _wait_idle(http)
    aborted = _aborted(http)
    body = {
        "model": MODEL,
        "prompt": "Keep going",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
        load = http.get("/v1/load").json()
        assert load["running"] + load["waiting"] == 1 and load["kv_blocks_used"] > 0
    # the connection is closed: the request is aborted and its blocks are free again
    _wait_idle(http)
    assert _aborted(http) == aborted + 1
    # the same for a non-streamed request whose client gives up waiting (steps slowed down so that
    # the request cannot finish first)
    runner = server.engine.runner
    original = runner.run

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return original(*args, **kwargs)

    runner.run = slow
    try:
        with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**body, "stream": False})
        _wait_idle(http, timeout=2.0)  # far less than the 4 s the request would have taken
    finally:
        runner.run = original
    assert _aborted(http) == aborted + 2


def _aborted(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "tokenops_engine_requests_finished":
            return sum(s.value for s in family.samples if s.labels.get("finish_reason") == "abort")
    return 0.0


def test_bad_inputs_get_openai_errors(client: openai.OpenAI, http: httpx.Client) -> None:
    def err(resp: httpx.Response, status: int, code: str | None = None) -> dict:
        assert resp.status_code == status, resp.text
        e = resp.json()["error"]
        assert e["message"] and e["type"]
        if code is not None:
            assert e["code"] == code, e
        return e

    err(http.post("/v1/chat/completions", content=b"{not json"), 400, "invalid_json")
    err(http.post("/v1/chat/completions", content=b"[1, 2]"), 400, "invalid_json")
    e = err(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
    assert e["param"] == "messages"
    err(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "missing_required_parameter")
    err(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400)
    err(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)
    err(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_k": 0}), 400)
    err(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "priority": "high"}), 400)
    err(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"x-priority": "soon"}),
        400,
    )
    err(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "presence_penalty": 1}), 400)
    err(http.get("/v1/nothing-here"), 404)

    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="x" * 300, max_tokens=4)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_much:
        client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=200, stream=True)
    assert too_much.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3.5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=0)
    # priority from the body or the header is accepted
    ok = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": -1},
        headers={"x-priority": "3"},
    )
    assert ok.status_code == 200


def test_models_health_metrics_load_and_kv_events(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get("/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="metrics please " * 3, max_tokens=3, temperature=0)
    _wait_idle(http)
    load = http.get("/v1/load").json()
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_usage", "tokens_in_flight"):
        assert key in load
    assert load["kv_blocks_total"] == 256
    # the step limits as the engine resolved them (the prefill step depends on the CPU: AMX or not)
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256
    )
    assert load["scheduler"] == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_chunk_tokens": None,
        "max_prefill_step_tokens": cfg.max_prefill_step_tokens,
    }
    assert load["block_size"] == 4
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in (
        "tokenops_engine_requests_running",
        "tokenops_engine_requests_waiting",
        "tokenops_engine_kv_blocks_used",
        "tokenops_engine_kv_blocks_total",
        "tokenops_engine_prefix_cache_queries",
        "tokenops_engine_prefix_cache_hits",
        "tokenops_engine_prompt_tokens",
        "tokenops_engine_generation_tokens",
        "tokenops_engine_time_to_first_token_seconds",
        "tokenops_engine_time_per_output_token_seconds",
        "tokenops_engine_e2e_request_latency_seconds",
    ):
        assert name in families, name
    gen = families["tokenops_engine_generation_tokens"].samples
    assert sum(s.value for s in gen if s.name.endswith("_total")) > 0
    ttft = [
        s
        for s in families["tokenops_engine_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert ttft[0].value > 0
    events = http.get("/v1/kv_events", params={"since": 0}).json()
    assert events["events"] and events["events"][0]["kind"] == "stored"
    later = http.get("/v1/kv_events", params={"since": events["next"]}).json()
    assert all(e["seq_no"] >= events["next"] for e in later["events"])
    assert http.get("/v1/kv_events", params={"since": "x"}).status_code == 400


def test_engine_failure_reaches_the_client(server, http: httpx.Client, client: openai.OpenAI) -> None:
    # fault injection: the model runner raises inside the engine thread
    runner = server.engine.runner
    original = runner.run
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        raise RuntimeError("injected fault")

    runner.run = failing
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=MODEL, prompt="boom", max_tokens=4)
        assert "injected fault" in str(exc.value)
    finally:
        runner.run = original
    assert calls["n"] >= 1
    # the engine carries on and frees what the failed request held
    ok = client.completions.create(model=MODEL, prompt="fine again", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2
    _wait_idle(http)


def test_model_without_chat_template_answers_chat_with_a_clear_400(tiny_gemma3) -> None:
    _, _, ctx = start_server(tiny_gemma3.model, ByteTokenizer(chat_template=None), "tiny-gemma")
    with ctx as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny-gemma", messages=MESSAGES)
        assert "/v1/completions" in exc.value.message
        ok = client.completions.create(
            model="tiny-gemma", prompt="Plain text works", max_tokens=3, temperature=0
        )
        assert ok.usage.completion_tokens == 3


@pytest.mark.bundled
@pytest.mark.timeout(300)
def test_bundled_smollm2_answers_a_chat_request() -> None:
    from tokenops.engine.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    engine = LLMEngine.from_loaded(loaded, EngineConfig(max_model_len=2048))
    app = build_app(
        engine, loaded.tokenizer, ServerConfig(served_model_names=[loaded.name], max_model_len=2048)
    )
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=loaded.name, messages=question, max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
        streamed = client.chat.completions.create(
            model=loaded.name, messages=question, max_tokens=24, temperature=0, stream=True
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            == r.choices[0].message.content
        )


# any JSON value, to put where a typed field is expected
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_fields = {
    "max_tokens": st.integers(-2, 40) | _json,
    "temperature": st.floats(-1, 3, allow_nan=False) | _json,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | _json,
    "top_k": st.integers(-3, 50) | _json,
    "n": st.integers(-1, 3) | _json,
    "seed": st.integers(-(2**63), 2**63) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | _json,
    "stop_token_ids": st.lists(st.integers(-5, 300), max_size=3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
    "logprobs": st.booleans() | st.integers(-1, 25) | _json,
    "top_logprobs": st.integers(-1, 25) | _json,
    "priority": st.integers(-5, 5) | _json,
    "ignore_eos": st.booleans() | _json,
}
_chat_body = st.fixed_dictionaries(
    {
        "model": st.just(MODEL) | st.text(max_size=5),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "bot"]), "content": st.text(max_size=20) | _json}
            ),
            max_size=2,
        )
        | _json,
    },
    optional=_fields,
)
_completion_body = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 300), max_size=5) | _json,
    },
    optional={**_fields, "echo": st.booleans() | _json, "suffix": st.text(max_size=3) | st.none()},
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route_body=st.tuples(st.just("/v1/chat/completions"), _chat_body)
    | st.tuples(st.just("/v1/completions"), _completion_body)
)
def test_fuzzed_requests_never_get_a_500(http: httpx.Client, route_body: tuple[str, dict]) -> None:
    route, body = route_body
    resp = http.post(route, content=orjson.dumps(body))
    assert resp.status_code in (200, 400, 404), (resp.status_code, resp.text, body)
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert err["message"] and err["type"]


def test_speculative_server_answers_as_plain_decoding(tiny_llama, client: openai.OpenAI) -> None:
    """Prompt lookup on: the same text, finish reason and billed tokens as the plain server, also
    when a stop string ends inside a multi-token speculative step; opt-out and counters."""
    spec = {"method": "ngram", "num_tokens": 4}
    _, _, ctx = start_server(tiny_llama.model, ByteTokenizer(), MODEL, speculative=spec)
    with ctx as url, httpx.Client(base_url=url, timeout=60) as http_spec:
        spec_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(
            model=MODEL,
            prompt="Copy: abcabcabc abcabcabc",
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        base, ours = client.completions.create(**kw), spec_client.completions.create(**kw)
        text = base.choices[0].text
        assert ours.choices[0].text == text and ours.usage.completion_tokens == base.usage.completion_tokens
        # a stop string that ends inside a speculative step of at least three tokens (one byte each)
        chunks = [c.choices[0].text for c in spec_client.completions.create(**kw, stream=True)]
        offset = next(sum(map(len, chunks[:i])) for i in range(1, len(chunks)) if len(chunks[i]) >= 3)
        stop = text[: offset + 2]
        cut_base = client.completions.create(**kw, stop=[stop])
        cut = spec_client.completions.create(**kw, stop=[stop])
        assert cut.choices[0].text == cut_base.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == cut_base.usage.completion_tokens
        streamed = spec_client.completions.create(**kw, stop=[stop], stream=True)
        assert "".join(c.choices[0].text for c in streamed) == cut_base.choices[0].text
        load = _wait_idle(http_spec)
        assert load["spec_draft_tokens"] > 0 and 0 < load["spec_acceptance_rate"] <= 1
        opted = spec_client.completions.create(
            **{**kw, "extra_body": {"ignore_eos": True, "speculative": False}}
        )
        assert opted.choices[0].text == text
        assert _wait_idle(http_spec)["spec_draft_tokens"] == load["spec_draft_tokens"]
        families = {f.name: f for f in text_string_to_metric_families(http_spec.get("/metrics").text)}
        drafted = families["tokenops_engine_spec_draft_tokens"].samples[0].value
        accepted = families["tokenops_engine_spec_accepted_tokens"].samples[0].value
        assert drafted == load["spec_draft_tokens"] and 0 < accepted <= drafted
        assert families["tokenops_engine_spec_mean_accepted_length"].samples[0].value >= 1
        bad = http_spec.post("/v1/completions", json={**kw, "extra_body": None, "speculative": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
