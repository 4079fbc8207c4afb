"""Reasoning budgets through the engine's HTTP server, with the official `openai` SDK: the thinking
comes back as `reasoning_content` (message and stream deltas), the answer as `content`, and
`usage.completion_tokens_details.reasoning_tokens` counts exactly the tokens between the markers.

The model is the tiny thinking Llama of tests/conftest.py: it never closes its thinking by itself,
so a budget of N gives exactly N reasoning tokens, and the text it writes is plain ASCII.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.reasoning import ReasoningMarkers
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

pytestmark = pytest.mark.timeout(300)

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
EFFORTS = {"none": 0, "low": 3, "medium": 9, "high": None}


def _start(loaded, markers: str | None):
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=64)
    )
    config = ServerConfig(
        served_model_names=[MODEL],
        max_model_len=engine.max_model_len,
        default_max_tokens=32,
        reasoning_markers=ReasoningMarkers.parse(loaded.tokenizer, markers),
        reasoning_effort_budgets=dict(EFFORTS),
    )
    return serve_in_thread(build_app(engine, loaded.tokenizer, config))


@pytest.fixture(scope="module")
def servers(thinker):
    """r1 (markers detected), plain (the same model, markers off), qwen3, reason (multi-token markers)."""
    ctxs = {
        "r1": _start(thinker("r1"), "auto"),
        "plain": _start(thinker("r1"), "none"),
        "qwen3": _start(thinker("qwen3"), "auto"),
        "reason": _start(thinker("reason"), "<reason>,</reason>"),
    }
    urls = {}
    try:
        for name, ctx in ctxs.items():
            urls[name] = ctx.__enter__()
        yield SimpleNamespace(
            **{
                name: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
                for name, url in urls.items()
            },
            urls=urls,
        )
    finally:
        for name in urls:
            ctxs[name].__exit__(None, None, None)


def chat(client: openai.OpenAI, max_tokens: int = 24, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, extra_body=extra or None
    )


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def stream_chat(client: openai.OpenAI, max_tokens: int = 24, **extra):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra or None,
    )
    reasoning, content, usage, chunks = [], [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            chunks += 1
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if choice.delta.content:
                content.append(choice.delta.content)
    return reasoning, content, usage, chunks


@pytest.mark.parametrize("budget", [1, 5, 12])
def test_budget_n_gives_n_reasoning_tokens_then_the_answer(servers, budget):
    r = chat(servers.r1, max_tokens=24, max_reasoning_tokens=budget)
    assert r.usage.completion_tokens_details.reasoning_tokens == budget
    assert r.usage.completion_tokens == 24  # reasoning + the forced </think> + the answer
    msg = r.choices[0].message
    # the thinking is the model's own: the same text a plain server writes in `budget` tokens
    assert reasoning_of(msg) == chat(servers.plain, max_tokens=budget).choices[0].message.content
    assert msg.content and "</think>" not in msg.content and "</think>" not in reasoning_of(msg)
    # the raw text of the same request has the end marker exactly between thinking and answer
    raw = servers.r1.completions.create(
        model=MODEL,
        prompt=_r1_prompt(),
        max_tokens=24,
        temperature=0,
        extra_body={"max_reasoning_tokens": budget},
    )
    assert raw.choices[0].text == reasoning_of(msg) + "</think>" + msg.content
    assert raw.usage.completion_tokens_details.reasoning_tokens == budget


def _r1_prompt() -> str:
    return "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_request_without_budget_is_unaffected(servers):
    thinking = chat(servers.r1, max_tokens=16)
    plain = chat(servers.plain, max_tokens=16)
    # same tokens: all of them thinking (the model never closes it), none lost or added
    assert reasoning_of(thinking.choices[0].message) == plain.choices[0].message.content
    assert thinking.choices[0].message.content == ""
    assert thinking.usage.completion_tokens_details.reasoning_tokens == 16
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert reasoning_of(plain.choices[0].message) is None


def test_streamed_split_matches_the_whole_answer(servers):
    whole = chat(servers.r1, max_tokens=20, max_reasoning_tokens=6)
    reasoning, content, usage, chunks = stream_chat(servers.r1, max_tokens=20, max_reasoning_tokens=6)
    assert "".join(reasoning) == reasoning_of(whole.choices[0].message)
    assert "".join(content) == whole.choices[0].message.content
    assert usage.completion_tokens_details.reasoning_tokens == 6 and usage.completion_tokens == 20
    assert chunks >= 10  # really streamed, token by token


def test_multi_token_markers_split_across_chunks(servers):
    whole = chat(servers.reason, max_tokens=30, max_reasoning_tokens=5)
    msg = whole.choices[0].message
    assert whole.usage.completion_tokens_details.reasoning_tokens == 5
    # 5 thinking tokens, the 9 tokens of </reason> spread over 9 engine steps, then 16 of answer
    assert len(reasoning_of(msg)) == 5 and len(msg.content) == 16
    reasoning, content, usage, _ = stream_chat(servers.reason, max_tokens=30, max_reasoning_tokens=5)
    assert "".join(reasoning) == reasoning_of(msg) and "".join(content) == msg.content
    assert not any("</" in piece for piece in reasoning + content[:1])
    assert usage.completion_tokens_details.reasoning_tokens == 5


def test_budget_zero_closes_an_opened_section_at_once(servers):
    r = chat(servers.r1, max_tokens=10, max_reasoning_tokens=0)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert reasoning_of(r.choices[0].message) is None
    assert len(r.choices[0].message.content) == 9  # the forced </think>, then 9 answer tokens


def test_budget_zero_prefills_an_empty_section_where_the_template_can(servers):
    thinking = chat(servers.qwen3, max_tokens=8)
    none = chat(servers.qwen3, max_tokens=8, max_reasoning_tokens=0)
    # Qwen3's enable_thinking=false: "<think>\n\n</think>\n\n" (6 tokens) in the prompt, no decode steps
    assert none.usage.prompt_tokens == thinking.usage.prompt_tokens + 6
    assert none.usage.completion_tokens_details.reasoning_tokens == 0
    assert reasoning_of(none.choices[0].message) is None and len(none.choices[0].message.content) == 8


def test_model_that_answers_without_thinking_reports_no_reasoning(servers):
    # the qwen3 template lets the model open the section; the biased model never does
    r = chat(servers.qwen3, max_tokens=8, max_reasoning_tokens=4)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert len(r.choices[0].message.content) == 8


def test_reasoning_effort_maps_to_a_budget(servers):
    assert chat(servers.r1, reasoning_effort="low").usage.completion_tokens_details.reasoning_tokens == 3
    medium = chat(servers.r1, max_tokens=24, reasoning_effort="medium", max_reasoning_tokens=4)
    assert medium.usage.completion_tokens_details.reasoning_tokens == 4  # the smaller budget wins
    high = chat(servers.r1, max_tokens=12, reasoning_effort="high")  # no budget: thinks to max_tokens
    assert high.usage.completion_tokens_details.reasoning_tokens == 12


def test_bad_reasoning_fields_are_400s(servers):
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers.r1, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort" and "low" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers.r1, max_reasoning_tokens=-1)
    assert e.value.body["param"] == "max_reasoning_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers.r1, chat_template_kwargs={"messages": []})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_budget_per_choice_and_in_metrics(servers):
    r = servers.r1.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0.8,
        seed=3,
        n=3,
        extra_body={"max_reasoning_tokens": 4},
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == 12  # 4 per choice
    assert all(len(reasoning_of(c.message)) == 4 for c in r.choices)
    metrics = httpx.get(servers.urls["r1"] + "/metrics").text
    closures = next(
        line
        for line in metrics.splitlines()
        if line.startswith("tokenops_engine_reasoning_budget_closures_total{")
    )
    assert float(closures.split()[-1]) >= 3
    assert "tokenops_engine_reasoning_tokens_total" in metrics
