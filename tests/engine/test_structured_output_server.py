"""Structured output and tool calls in the engine, through the official `openai` SDK against a real
engine server on loopback (the tiny random Llama and the byte tokenizer of test_server.py; the
bundled SmolLM2 at the end). A random model writes whatever the mask leaves it, so what it returns
parsing and validating is the grammar's doing.

The mask touches only the rows of constrained requests: a plain request batched with constrained
ones gets the tokens it gets alone.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema_rs
import openai
import pytest
import torch

from tiny_server import ByteTokenizer, start_server
from tokenops.engine.config import EngineConfig
from tokenops.engine.grammar import GrammarCompiler
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.sampling_params import SamplingParams
from tokenops.structured_output import output_spec

from .test_server import MODEL

pytestmark = pytest.mark.timeout(180)

# bounded values only: a random model under this schema always finishes the object
ORDER = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "gift": {"type": "boolean"},
    },
    "required": ["size", "count", "gift"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "place_order", "parameters": ORDER}},
    {
        "type": "function",
        "function": {
            "name": "cancel",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["order"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "Order two small cups."}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # the byte tokenizer's template does not render tools: the Hermes tool prompt makes prompts long
    engine, app, ctx = start_server(
        tiny_llama.model,
        ByteTokenizer(),
        MODEL,
        num_kv_blocks=1024,
        max_model_len=1536,
        max_num_batched_tokens=256,
    )
    with ctx as url:
        yield SimpleNamespace(url=url, engine=engine)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def order_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}


def test_json_schema_output_parses_and_validates_for_every_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        temperature=1.0,
        seed=3,
        n=4,
        response_format=order_format(),
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(ORDER, json.loads(choice.message.content))
    assert len({c.message.content for c in r.choices}) > 1  # the mask narrows, sampling still samples


def test_streamed_json_concatenates_to_the_whole_answer(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format=order_format())
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
    )
    assert streamed == whole
    jsonschema_rs.validate(ORDER, json.loads(whole))


def test_named_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "cancel"}},
        max_tokens=40,
        temperature=0,
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "cancel" and call.id.startswith("call_")
    jsonschema_rs.validate(TOOLS[1]["function"]["parameters"], json.loads(call.function.arguments))

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "cancel" and deltas[0].tool_calls[0].id
    assert "".join(d.tool_calls[0].function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_returns_calls_to_known_functions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema_rs.validate(schemas[call.function.name], json.loads(call.function.arguments))


def test_bad_output_requests_are_clear_400s(client: openai.OpenAI) -> None:
    cases = [
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "refund"}}),
            "tool_not_found",
        ),
        (dict(tool_choice="required"), "invalid_value"),
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "x"}}}
            ),
            "invalid_json_schema",
        ),
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
            ),
            "unsupported_json_schema",
        ),
    ]
    for extra, code in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)
        assert exc.value.status_code == 400 and exc.value.code == code, (extra, exc.value.body)
        assert exc.value.body["message"]


def test_the_mask_leaves_unconstrained_rows_of_a_batch_alone(tiny_llama) -> None:
    tok = ByteTokenizer()
    engine = LLMEngine(
        tiny_llama.model,
        EngineConfig(
            block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256
        ),
        eos_token_ids=tok.eos_token_ids,
    )
    compiler = GrammarCompiler(tok.backend.to_str(), engine.model_config.vocab_size, tok.eos_token_ids)
    grammar = compiler.compile(output_spec(None, None, order_format()).grammar)
    prompt = tok.encode(
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = engine.generate([prompt], plain)[0]
    constrained = SamplingParams(max_tokens=60, temperature=0, grammar=grammar)
    mixed = engine.generate([prompt, prompt, prompt], [constrained, plain, constrained])
    assert mixed[1] == alone
    for ids in (mixed[0], mixed[2]):
        text = tok.decode([t for t in ids if t not in tok.eos_token_ids])
        jsonschema_rs.validate(ORDER, json.loads(text))
    assert torch.get_num_threads() >= 1


@pytest.mark.bundled
@pytest.mark.timeout(400)
def test_bundled_smollm2_returns_valid_json_and_valid_calls() -> None:
    from tokenops.engine.loader import load_model
    from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

    loaded = load_model("smollm2-135m-instruct")
    engine = LLMEngine.from_loaded(loaded, EngineConfig(max_model_len=2048))
    app = build_app(
        engine, loaded.tokenizer, ServerConfig(served_model_names=[loaded.name], max_model_len=2048)
    )
    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": True}}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        kw = dict(model=loaded.name, max_tokens=80, temperature=0)
        r = client.chat.completions.create(
            messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
            response_format={"type": "json_object"},
            **kw,
        )
        assert r.choices[0].finish_reason == "stop" and isinstance(
            json.loads(r.choices[0].message.content), dict
        )
        person = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        }
        r = client.chat.completions.create(
            messages=[{"role": "user", "content": "Ann is 31. Give her as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": person, "strict": True},
            },
            **kw,
        )
        assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}
        jsonschema_rs.validate(person, json.loads(r.choices[0].message.content))
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(messages=question, tools=tools, tool_choice=choice, **kw)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema_rs.validate(weather, json.loads(call.function.arguments))
