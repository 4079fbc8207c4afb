"""Structured output on a reasoning model, through the official `openai` SDK against a real engine
server: the grammar constrains the answer after the thinking section, never the thinking itself (as
vLLM's reasoning parser does with structured output).

The model is the tiny thinking Llama of tests/conftest.py, whose chat template opens a section ("r1")
or lets the model open one ("qwen3"). It never closes its thinking by itself, so a thinking budget
ends it. Its test bias bans end-of-turn; here end-of-turn gets a very low finite logit instead, so the
model ends only where a finished grammar leaves it nothing else.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema_rs
import openai
import pytest

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.reasoning import ReasoningMarkers
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

from .test_structured_output_server import ORDER, TOOLS, order_format

pytestmark = pytest.mark.timeout(300)

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Order two small cups."}]
BUDGET = 12
EOS = 2  # the thinker's end-of-turn token (tests/conftest.py)


def _end_only_when_nothing_else(model) -> None:  # noqa: ANN001
    compute = model.compute_logits

    def logits(hidden):  # noqa: ANN001, ANN202
        out = compute(hidden)
        out[:, EOS] = -1e4
        return out

    model.compute_logits = logits


@pytest.fixture(scope="module")
def servers(thinker):
    ctxs = {}
    for style in ("r1", "qwen3"):
        loaded = thinker(style)
        _end_only_when_nothing_else(loaded.model)
        engine = LLMEngine.from_loaded(
            loaded, EngineConfig(block_size=4, num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=128)
        )
        config = ServerConfig(
            served_model_names=[MODEL],
            max_model_len=engine.max_model_len,
            reasoning_markers=ReasoningMarkers.parse(loaded.tokenizer, "auto"),
        )
        ctxs[style] = serve_in_thread(build_app(engine, loaded.tokenizer, config))
    urls = {}
    try:
        for style, ctx in ctxs.items():
            urls[style] = ctx.__enter__()
        yield SimpleNamespace(
            **{
                style: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
                for style, url in urls.items()
            }
        )
    finally:
        for style in urls:
            ctxs[style].__exit__(None, None, None)


def reasoning_of(message) -> str | None:  # noqa: ANN001
    return (message.model_extra or {}).get("reasoning_content")


def test_the_thinking_is_free_and_the_answer_validates(servers) -> None:
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, extra_body={"max_reasoning_tokens": BUDGET})
    r = servers.r1.chat.completions.create(**kw, max_tokens=160, response_format=order_format())
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET
    # the thinking is what the model writes with no format asked: the grammar did not touch it
    free = servers.r1.chat.completions.create(**kw, max_tokens=BUDGET).choices[0].message
    assert reasoning_of(choice.message) == reasoning_of(free) and len(reasoning_of(free)) == BUDGET
    jsonschema_rs.validate(ORDER, json.loads(choice.message.content))

    # streamed: the same thinking, then the same answer
    reasoning, content = [], []
    for chunk in servers.r1.chat.completions.create(
        **kw, max_tokens=160, response_format=order_format(), stream=True
    ):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == reasoning_of(choice.message)
    assert "".join(content) == choice.message.content


def test_sampled_choices_think_freely_and_all_validate(servers) -> None:
    r = servers.r1.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=160,
        temperature=1.0,
        seed=5,
        n=3,
        response_format=order_format(),
        extra_body={"max_reasoning_tokens": BUDGET},
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(ORDER, json.loads(choice.message.content))
    # thinking sampled without the mask: not JSON, and different from one choice to the next
    thoughts = [reasoning_of(c.message) for c in r.choices]
    assert len(set(thoughts)) == len(thoughts) and not any(t.lstrip().startswith("{") for t in thoughts)


def test_a_forced_tool_call_follows_the_thinking(servers) -> None:
    r = servers.r1.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "cancel"}},
        max_tokens=64,  # the tools in the prompt take most of the window
        temperature=0,
        extra_body={"max_reasoning_tokens": BUDGET},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(reasoning_of(choice.message)) == BUDGET
    (call,) = choice.message.tool_calls
    assert call.function.name == "cancel"
    jsonschema_rs.validate(TOOLS[1]["function"]["parameters"], json.loads(call.function.arguments))


def test_a_model_that_may_think_but_answers_at_once_is_constrained_from_the_first_token(servers) -> None:
    # qwen3's template leaves opening a section to the model; this one never opens it
    r = servers.qwen3.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, response_format=order_format()
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens_details.reasoning_tokens == 0
    jsonschema_rs.validate(ORDER, json.loads(choice.message.content))
