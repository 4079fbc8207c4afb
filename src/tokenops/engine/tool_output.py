"""A chat choice's answer when the request has tools: its content and its tool calls, whole and as
OpenAI's streamed deltas.

The tool mode decides how the text is read (see `tokenops.structured_output`):
- `named`: the text is the forced function's arguments (grammar-constrained JSON); it streams as
  argument deltas of one call from its first token.
- `required`: the text is a JSON list of `{"name", "arguments"}`; the calls go out when it is complete.
- `auto`: the model's own text, read by the family's `ToolParser`; content streams until what may
  open a call, which is held back and sent as calls (or as content, if it is none) at the end.
A choice that produced calls finishes with `tool_calls`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenops.engine.tool_parsers import ToolCall, ToolParser, make_call, new_call_id


class ToolOutput:
    def __init__(
        self, mode: str, parser: ToolParser, names: set[str], forced_name: str | None = None
    ) -> None:
        self.mode = mode  # "auto" | "required" | "named"
        self.parser = parser
        self.names = names
        self.forced_name = forced_name
        self._text = ""  # streamed so far
        self._released = 0  # characters of it already sent as content
        self._named_id = new_call_id()
        self._parsed: tuple[str, tuple[str | None, list[ToolCall]]] | None = None

    # -- the whole answer ---------------------------------------------------------------------

    def result(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the finished text (the same calls, ids included, on every call)."""
        if self._parsed is None or self._parsed[0] != text:
            self._parsed = (text, self._read(text))
        return self._parsed[1]

    def _read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return None, [ToolCall(self.forced_name or "", text, self._named_id)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut off by max_tokens: what there is stays content
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                return text, []
            calls = [make_call(i.get("name"), i.get("arguments"), self.names) for i in items]
            return (None, [c for c in calls if c is not None]) if all(calls) else (text, [])
        return self.parser.parse(text, self.names)

    # -- streaming ----------------------------------------------------------------------------

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        """The chat delta fields (`content`, `tool_calls`) for `new_text`, the choice's next text."""
        start = len(self._text)
        self._text += new_text
        if self.mode == "named":
            if not new_text and not finished:
                return {}
            call: dict[str, Any] = {"index": 0, "function": {"arguments": new_text}}
            if start == 0:  # the first delta of a call names it
                call.update(id=self._named_id, type="function")
                call["function"]["name"] = self.forced_name
            return {"tool_calls": [call]}
        if not finished:
            if self.mode == "required":
                return {}
            safe = self._safe_length(self._text)
            out = self._text[self._released : safe]
            self._released = max(self._released, safe)
            return {"content": out} if out else {}
        content, calls = self.result(self._text)
        fields: dict[str, Any] = {}
        if calls:
            rest = (content or "")[self._released :]
        else:
            rest = self._text[self._released :]
        if rest:
            fields["content"] = rest
        if calls:
            fields["tool_calls"] = [{"index": i, **c.to_json()} for i, c in enumerate(calls)]
        self._released = len(self._text)
        return fields

    def _safe_length(self, text: str) -> int:
        """How much of `text` is content for sure: up to where a call may begin."""
        marker = self.parser.start
        if marker == "{":  # llama3_json: the call is the whole answer
            head = text.lstrip()
            return 0 if not head or head[0] == "{" or "<|python_tag|>".startswith(head[:14]) else len(text)
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)
