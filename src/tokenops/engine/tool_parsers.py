"""Tool calls out of a model's text, per model family's format.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes, and
  the ChatML models that take the Hermes tool prompt, SmolLM2 among them).
- `llama3_json`: the answer is one JSON call `{"name": ..., "parameters": {...}}` (or several joined by
  `;`), optionally after `<|python_tag|>` (Llama 3.1+).
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.

As in vLLM and SGLang the parser is a per-model choice; `parser_for` picks it from the chat template's
markers (a config override wins). A parser only returns calls that name a function of the request's
tools with JSON-object arguments; anything else stays content. `start` is the text that opens a call,
so a streaming server can hold back what may become one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: Any, arguments: Any, names: set[str]) -> ToolCall | None:
    """A call if it names a known function and its arguments are a JSON object (or its text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


class ToolParser:
    name = ""
    start = ""  # text that opens a call in this format

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); when no valid call is found, all of `text` is content."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]):
            obj = _loads(body)
            call = make_call(obj.get("name"), obj.get("arguments"), names) if isinstance(obj, dict) else None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:at].strip() or None), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    _tag = "<|python_tag|>"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._tag).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_objects(body):
            obj = _loads(part)
            if not isinstance(obj, dict):
                return text, []
            call = make_call(obj.get("name"), obj.get("parameters", obj.get("arguments")), names)
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        # the marker is a special token a detokenizer may drop: a bare list of calls counts too
        body = text[at + len(self.start) :] if at >= 0 else text.lstrip()
        if at < 0 and not body.startswith("[{"):
            return text, []
        items = _loads(body.strip())
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list) or not items:
            return text, []
        calls = []
        for obj in items:
            call = make_call(obj.get("name"), obj.get("arguments"), names) if isinstance(obj, dict) else None
            if call is None:
                return text, []
            calls.append(call)
        return ((text[:at].strip() or None) if at >= 0 else None), calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(chat_template: str | None, override: str | None = None) -> ToolParser:
    """The parser of a model family: `override` (a name in `PARSERS`) or the template's markers;
    ChatML and templates that do not render tools take Hermes (the prompt the server adds)."""
    if override:
        if override not in PARSERS:
            raise ValueError(f"unknown tool parser {override!r}; known: {', '.join(sorted(PARSERS))}")
        return PARSERS[override]()
    t = chat_template or ""
    if "<tool_call>" in t:
        return HermesParser()
    if "[TOOL_CALLS]" in t or "[AVAILABLE_TOOLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return Llama3JsonParser()
    return HermesParser()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` into its objects (a `;` inside a string is no separator)."""
    decoder = json.JSONDecoder()
    parts, i = [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return [body]
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return parts
