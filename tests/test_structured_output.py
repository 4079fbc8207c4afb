"""`output_spec`: the output a chat request asks for, and the 400s for what cannot be served (the
gateway and the engine both call it)."""

from __future__ import annotations

import json

import llguidance
import pytest

from tokenops.protocol import APIError
from tokenops.structured_output import output_spec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def refusal(*args) -> APIError:
    with pytest.raises(APIError) as exc:
        output_spec(*args)
    assert exc.value.status == 400 and exc.value.type == "invalid_request_error"
    return exc.value


def test_plain_requests_are_unconstrained() -> None:
    assert output_spec(None, None, None).grammar is None
    assert output_spec(None, None, {"type": "text"}).grammar is None
    auto = output_spec([WEATHER], None, None)
    assert auto.tool_mode == "auto" and auto.grammar is None
    assert output_spec([WEATHER], "none", None).tool_mode == "none"


def test_json_modes_and_forced_calls_carry_a_grammar() -> None:
    assert output_spec(None, None, {"type": "json_object"}).json_output
    assert output_spec(None, None, schema_format({"type": "object"})).grammar
    named = output_spec([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.tool_mode == "named" and named.tool_name == "get_weather" and named.grammar
    required = output_spec([WEATHER], "required", None)
    assert required.tool_mode == "required" and required.forced_call


def test_a_forced_call_wins_over_response_format() -> None:
    spec = output_spec([WEATHER], "required", {"type": "json_object"})
    assert spec.forced_call and not spec.json_output


def test_strict_closes_objects_to_their_listed_properties() -> None:
    spec = output_spec(
        None, None, {**schema_format({"type": "object", "properties": {"a": {"type": "integer"}}})}
    )
    loose = json.loads(spec.grammar)["grammars"][0]["json_schema"]
    assert "additionalProperties" not in loose
    strict_format = schema_format({"type": "object", "properties": {"a": {"type": "integer"}}})
    strict_format["json_schema"]["strict"] = True
    closed = json.loads(output_spec(None, None, strict_format).grammar)["grammars"][0]["json_schema"]
    assert closed["additionalProperties"] is False


def test_tool_choice_naming_a_missing_function_is_a_400() -> None:
    err = refusal([WEATHER], {"type": "function", "function": {"name": "send_email"}}, None)
    assert err.param == "tool_choice" and err.code == "tool_not_found" and "get_weather" in err.message
    assert refusal(None, "required", None).param == "tool_choice"
    assert refusal([WEATHER], "sometimes", None).param == "tool_choice"
    assert refusal([WEATHER], {"type": "function", "function": {}}, None).param == "tool_choice"


def test_an_invalid_json_schema_is_a_400() -> None:
    err = refusal(None, None, schema_format({"type": "integer-ish"}))
    assert err.code == "invalid_json_schema" and err.param == "response_format.json_schema.schema"
    assert refusal(None, None, schema_format({"minimum": "zero"})).code == "invalid_json_schema"
    assert refusal(None, None, schema_format([1, 2])).code == "invalid_json_schema"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    assert refusal([bad_tool], "auto", None).code == "invalid_json_schema"
    assert refusal(None, None, {"type": "json_schema"}).param == "response_format.json_schema"
    assert refusal(None, None, {"type": "json_schema", "json_schema": {"schema": {}}}).param == (
        "response_format.json_schema"
    )


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {"type": "string"}},
        {"type": "array", "uniqueItems": True},
        {"type": "string", "pattern": "(?<=a)b"},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    ],
)
def test_schema_features_the_grammar_cannot_enforce_are_a_400(schema) -> None:
    err = refusal(None, None, schema_format(schema))
    assert err.code == "unsupported_json_schema" and "cannot enforce" in err.message


def test_the_required_grammar_accepts_a_list_of_calls_only() -> None:
    tok = llguidance.LLTokenizer(_byte_tokenizer_json())
    grammar = output_spec([WEATHER], "required", None, False).grammar
    ok = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert m.consume_tokens(tok.tokenize_str(ok)) and m.is_accepting()
    for bad in ('[{"name": "other", "arguments": {}}]', "[]", ok[:-1] + ", " + ok[1:]):
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not (m.consume_tokens(tok.tokenize_str(bad)) and m.is_accepting()), bad


def _byte_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return tok.to_str()
