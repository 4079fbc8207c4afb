"""Tool calls read from model text per family, the parser chosen from the chat template, and the
streamed deltas of a choice's tool calls adding up to its whole answer."""

from __future__ import annotations

import json

import pytest

from tokenops.engine.tool_output import ToolOutput
from tokenops.engine.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, parser_for
from tokenops.modelfiles.tool_prompt import prompt_messages

NAMES = {"get_weather", "add"}


def test_hermes_blocks_become_calls_and_text_before_them_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    content, calls = HermesParser().parse(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        "<tool_call>not json</tool_call>",
    ],
)
def test_what_is_not_a_valid_call_stays_content(text: str) -> None:
    assert HermesParser().parse(text, NAMES) == (text, [])


def test_llama3_json_calls() -> None:
    content, calls = Llama3JsonParser().parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}',
        NAMES,
    )
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert Llama3JsonParser().parse("The answer is {1}", NAMES) == ("The answer is {1}", [])


def test_mistral_calls_with_and_without_the_marker() -> None:
    content, calls = MistralParser().parse('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}]', NAMES)
    assert content is None and json.loads(calls[0].arguments) == {"a": 2}
    assert MistralParser().parse('[{"name": "add", "arguments": {}}]', NAMES)[1][0].name == "add"


def test_the_parser_is_chosen_from_the_template_and_overridable() -> None:
    assert parser_for("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for("[AVAILABLE_TOOLS] {{ tools }}").name == "mistral"
    assert parser_for("<|start_header_id|>{% if tools %}{% endif %}").name == "llama3_json"
    assert parser_for("<|im_start|>{{ m.content }}").name == "hermes"  # ChatML takes the Hermes prompt
    assert parser_for("<tool_call>", override="mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool parser"):
        parser_for(None, override="nope")


def test_a_template_without_tools_gets_the_hermes_prompt_and_tool_turns_as_text() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    out = prompt_messages("<|im_start|>{{ m.content }}", messages, tools)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert prompt_messages("{% for t in tools %}{% endfor %}", messages, tools) is messages


def _stream(out: ToolOutput, pieces: list[str]) -> list[dict]:
    return [out.delta(p, finished=(i == len(pieces) - 1)) for i, p in enumerate(pieces)]


def _accumulate(deltas: list[dict]) -> tuple[str, dict[int, dict]]:
    """What the openai SDK's stream helpers do: concatenate content and each call's fields by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            acc = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.get("id") or acc["id"]
            acc["name"] += tc.get("function", {}).get("name") or ""
            acc["arguments"] += tc.get("function", {}).get("arguments") or ""
    return content, calls


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_streamed_auto_deltas_hold_back_a_call_and_add_up_to_the_answer(cut: int) -> None:
    text = 'Checking <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    out = ToolOutput("auto", HermesParser(), NAMES)
    deltas = _stream(out, pieces)
    content, calls = _accumulate(deltas)
    whole_content, whole_calls = out.result(text)
    assert "<" not in content and content.strip() == whole_content
    assert calls == {0: {"id": whole_calls[0].id, "name": "add", "arguments": whole_calls[0].arguments}}


def test_streamed_named_call_sends_its_arguments_as_they_come() -> None:
    out = ToolOutput("named", HermesParser(), NAMES, "add")
    deltas = _stream(out, ['{"a"', ": 1", "}"])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a"'}
    assert "name" not in deltas[1]["tool_calls"][0]["function"]
    _, calls = _accumulate(deltas)
    assert calls[0]["arguments"] == '{"a": 1}' and calls[0]["id"] == out.result('{"a": 1}')[1][0].id


def test_required_calls_go_out_whole_at_the_end() -> None:
    out = ToolOutput("required", HermesParser(), NAMES)
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    deltas = _stream(out, [text[:10], text[10:]])
    assert deltas[0] == {}
    _, calls = _accumulate(deltas)
    assert [c["name"] for c in calls.values()] == ["add", "get_weather"]
    truncated = ToolOutput("required", HermesParser(), NAMES)
    assert truncated.result(text[:20]) == (text[:20], [])
