"""What a chat request asks its output to be: free text, JSON (`response_format`), or tool calls
(`tools` with `tool_choice`), checked together and turned into one `OutputSpec`.

`output_spec` refuses what cannot be served with an OpenAI-style 400 that names the field: a
`tool_choice` naming a function that is not in `tools`, a schema that is not a JSON Schema (checked
against the meta-schema), or one using features the grammar library cannot enforce. When the output
is constrained, the spec carries an llguidance grammar, which the engine compiles once per request
against its tokenizer and applies as a token mask; the gateway calls the same function so a bad
request is refused before it reaches any backend.

A forced call is decoded as bare JSON, as vLLM does: a named function's arguments object, or for
`required` a list of `{"name", "arguments"}` objects. Free-text answers with tools (`auto`) are parsed
per model family by the engine's tool parsers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema_rs
import llguidance
import orjson

from tokenops.protocol import APIError, invalid_request

ToolMode = Literal["none", "auto", "required", "named"]

# JSON as a model writes it unprompted ("a": 1, "b": 2), and no runaway whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class OutputSpec:
    tool_mode: ToolMode = "none"
    tool_name: str | None = None  # the function a named tool_choice forces
    grammar: str | None = None  # llguidance grammar (JSON text) the output must match; None: free
    json_output: bool = False  # response_format asks for JSON (json_object or json_schema)

    @property
    def forced_call(self) -> bool:
        return self.tool_mode in ("required", "named")


def output_spec(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    response_format: dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
) -> OutputSpec:
    """The output a request asks for; raises `APIError` (400) for what cannot be served."""
    functions = {t["function"]["name"]: t["function"] for t in tools or ()}
    mode, name = _tool_mode(functions, tool_choice)
    for fname, fn in functions.items():
        params = fn.get("parameters")
        if params is not None:
            _check_schema(params, f"tools.function.parameters ({fname})")
    if mode == "named":
        schema = _strict(functions[name].get("parameters") or EMPTY_PARAMETERS, functions[name].get("strict"))
        return OutputSpec(mode, name, _grammar(schema, f"tools.function.parameters ({name})"))
    if mode == "required":
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": fname},
                            "arguments": _strict(fn.get("parameters") or EMPTY_PARAMETERS, fn.get("strict")),
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for fname, fn in functions.items()
                ]
            },
        }
        if parallel_tool_calls is False:
            calls["maxItems"] = 1
        return OutputSpec(mode, None, _grammar(calls, "tools"))
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return OutputSpec(mode, None, _grammar({"type": "object"}, "response_format"), json_output=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise invalid_request(
                "response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}.",
                param=param,
            )
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise invalid_request("response_format.json_schema.name must be a non-empty string.", param=param)
        schema = spec.get("schema", {})
        _check_schema(schema, f"{param}.schema")
        schema = _strict(schema, spec.get("strict"))
        return OutputSpec(mode, None, _grammar(schema, f"{param}.schema"), json_output=True)
    return OutputSpec(mode)


def _tool_mode(functions: dict[str, Any], tool_choice: Any) -> tuple[ToolMode, str | None]:
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not functions:
            raise invalid_request(
                "tool_choice 'required' needs at least one tool in tools.", param="tool_choice"
            )
        return ("none" if not functions else tool_choice), None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise invalid_request(
                "tool_choice must be {'type': 'function', 'function': {'name': <string>}}.",
                param="tool_choice",
            )
        if name not in functions:
            known = ", ".join(sorted(functions)) or "none"
            raise invalid_request(
                f"tool_choice names the function '{name}', which is not in tools (tools: {known}).",
                param="tool_choice",
                code="tool_not_found",
            )
        return "named", name
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
        param="tool_choice",
    )


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise invalid_request(
            f"{param} must be a JSON Schema object.", param=param, code="invalid_json_schema"
        )
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        first = str(exc).splitlines()[0]
        raise invalid_request(
            f"{param} is not a valid JSON Schema: {first}", param=param, code="invalid_json_schema"
        ) from None
    except jsonschema_rs.ReferencingError as exc:
        raise invalid_request(
            f"{param} is not a valid JSON Schema: {exc}", param=param, code="invalid_json_schema"
        ) from None


def _strict(schema: Any, strict: Any) -> Any:
    """OpenAI's strict mode: objects take only their listed properties unless they say otherwise."""
    if strict is not True:
        return schema
    if isinstance(schema, list):
        return [_strict(s, True) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (_strict(v, True) if k not in ("const", "enum", "default", "examples") else v)
        for k, v in schema.items()
    }
    if "properties" in schema:
        out["properties"] = {k: _strict(v, True) for k, v in schema["properties"].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _grammar(schema: dict[str, Any], param: str) -> str:
    # no key sorting: the order of `properties` is the order the model writes them in
    grammar, error = _compile(orjson.dumps(schema).decode())
    if error:
        raise APIError(
            400,
            f"{param} uses JSON Schema features that constrained decoding cannot enforce: {error}",
            param=param,
            code="unsupported_json_schema",
        )
    return grammar


@functools.lru_cache(maxsize=512)
def _compile(schema_json: str) -> tuple[str, str]:
    """(grammar, error message or ''): agents send the same tool schemas on every turn."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults=JSON_OPTIONS)
    except ValueError as exc:
        return "", str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return grammar, (messages[0] if is_error else "")
