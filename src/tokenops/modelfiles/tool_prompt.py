"""Tools for chat templates that do not render them: the Hermes tool prompt, and earlier tool calls
and results written the way that prompt taught the model.

Many small ChatML models (SmolLM2 among them) ship a template that ignores `tools`, `tool_calls`
and the `tool` role. For those the tool definitions go into the system message in the Hermes format
(the one Qwen2.5 and Hermes models are trained on), an assistant's calls become `<tool_call>` blocks
and a tool's result a user turn inside `<tool_response>`. The engine server renders with this, and
so does the gateway's prompt tokeniser, so both see the same prompt.
"""

from __future__ import annotations

import json
from typing import Any

HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template writes the request's tools into the prompt itself."""
    return bool(chat_template) and "tools" in chat_template


def prompt_messages(
    chat_template: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The messages a template renders: as they are when it handles tools, else `with_tool_prompt`'s."""
    if renders_tools(chat_template):
        return messages
    if tools or any(m.get("role") in ("tool", "function") or m.get("tool_calls") for m in messages):
        return with_tool_prompt(messages, tools)
    return messages


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` with the tools in the system message and tool turns as plain text (see above)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            content = "\n".join(filter(None, [m.get("content") or "", *calls]))
            out.append({"role": "assistant", "content": content})
        elif role in ("tool", "function"):
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
            )
        else:
            out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = HERMES_INSTRUCTIONS.format(tools=listing)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{instructions}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except json.JSONDecodeError:
        pass  # the model's own malformed arguments go back as it wrote them
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
