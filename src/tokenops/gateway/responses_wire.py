"""OpenAI's Responses API in terms of chat completions: the request, the response object and the
streaming events.

This module owns the translation both ways and nothing else: a Responses request (`input` items,
`instructions`, function `tools`, `tool_choice`, `text.format`, `max_output_tokens`) validated and
turned into chat messages and a chat body; a chat answer turned into output items (`message` with
`output_text`, `function_call`) and the Responses `usage`; and a chat stream turned, chunk by chunk,
into the Responses events (`response.created`, `response.output_text.delta`,
`response.function_call_arguments.delta`, `response.completed`, ... each with its sequence number).
It does not store, compact or send anything (responses.py does).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenops.protocol import APIError, from_validation_error, invalid_request


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


class ResponsesRequest(BaseModel):
    """The fields of `POST /v1/responses` the gateway honours; anything else is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(
            f"The request body is not valid JSON ({exc.msg} at position {exc.pos}). Send a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _content_text(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or its parts as chat content parts (text and images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"'{param}' must be a string or a list of content parts.", param=param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise invalid_request(
                f"'{param}[{i}]' must be an input_text, output_text or input_image part.",
                param=f"{param}[{i}]",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # plain text renders the same whichever way it came
    return parts


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`: a string is one user message; items are messages,
    function calls (consecutive ones join one assistant message) and function call outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid_request(
                    f"'{param}.role' must be user, assistant, system or developer.", param=f"{param}.role"
                )
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content_text(item.get("content"), f"{param}.content"),
                }
            )
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
                raise invalid_request(
                    f"'{param}' (function_call) needs call_id, name and arguments as strings.", param=param
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise invalid_request(
                    f"'{param}' (function_call_output) needs call_id and output as strings.", param=param
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise invalid_request(
                f"'{param}.type' is '{kind}'; the gateway takes message, function_call and "
                "function_call_output items.",
                param=f"{param}.type",
            )
    if not messages:
        raise invalid_request("'input' must not be empty.", param="input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as chat tools (nested under `function`)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise invalid_request(
                f"'tools[{i}]' must be {{'type': 'function', 'name': <string>, ...}}; the gateway "
                "serves function tools only.",
                param=f"tools[{i}]",
            )
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> Any:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise invalid_request(
                "'tool_choice' must be auto, none, required or a function.", param="tool_choice"
            )
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid_request(
            "'tool_choice' must be {'type': 'function', 'name': <string>}.", param="tool_choice"
        )
    if name not in {t.get("name") for t in tools or ()}:
        raise invalid_request(
            f"'tool_choice' names the function '{name}', which is not in 'tools'.", param="tool_choice"
        )
    return {"type": "function", "function": {"name": name}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (json_schema's fields move under `json_schema`)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise invalid_request("'text.format' must be an object with a 'type'.", param="text.format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise invalid_request("'text.format.type' must be text, json_object or json_schema.", param="text.format")


def chat_body(req: ResponsesRequest, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request that answers `req` over `messages` (instructions included)."""
    body: dict[str, Any] = {"model": model, "messages": messages}
    tools = chat_tools(req.tools)
    if tools:
        body["tools"] = tools
    choice = chat_tool_choice(req.tool_choice, req.tools)
    if choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = chat_response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        value = getattr(req, ours)
        if value is not None:
            body[theirs] = value
    if req.user is not None:
        body["user"] = req.user
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def responses_usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if not u:
        return None
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
        },
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]
        if status == "completed"
        else [],
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message the answer adds to the session's history."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass(slots=True)
class ResponseShape:
    """What a response object repeats of its request."""

    id: str
    model: str
    req: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "truncation": r.truncation or "disabled",
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": usage,
        }


def finish_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


@dataclass(slots=True)
class Finished:
    """A whole answer in both shapes: the response object and the history message it adds."""

    body: dict[str, Any]
    message: dict[str, Any]
    usage: dict[str, Any] | None  # the chat usage


def from_completion(shape: ResponseShape, obj: dict[str, Any]) -> Finished:
    """A whole chat completion as a response."""
    choice = (obj.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    text = msg.get("content") or ""
    calls = msg.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append(message_item(new_item_id("msg"), text))
    for c in calls:
        fn = c.get("function") or {}
        output.append(
            call_item(
                new_item_id("fc"),
                c.get("id") or new_item_id("call"),
                fn.get("name", ""),
                fn.get("arguments", ""),
            )
        )
    status, reason = finish_status(choice.get("finish_reason"))
    usage = obj.get("usage")
    return Finished(
        shape.body(status, output, responses_usage(usage), incomplete=reason),
        assistant_message(text, [_wire_call(c) for c in calls]),
        usage,
    )


def _wire_call(c: dict[str, Any]) -> dict[str, Any]:
    fn = c.get("function") or {}
    return {
        "id": c.get("id"),
        "type": "function",
        "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")},
    }


@dataclass(slots=True)
class _Call:
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str = ""


class StreamTranslator:
    """A chat stream's chunks in, Responses events out, numbered in order. The message item opens on
    the first text delta, each tool call's item on its first delta; `finish` closes them."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.text = ""
        self.text_item: str | None = None
        self.text_index = -1
        self.calls: dict[int, _Call] = {}
        self.next_index = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        skeleton = self.shape.body("in_progress", [])
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self.text_item is None:
                    self.text_item, self.text_index = new_item_id("msg"), self.next_index
                    self.next_index += 1
                    out.append(
                        self._event(
                            "response.output_item.added",
                            output_index=self.text_index,
                            item=message_item(self.text_item, "", "in_progress"),
                        )
                    )
                    out.append(
                        self._event(
                            "response.content_part.added",
                            item_id=self.text_item,
                            output_index=self.text_index,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    )
                self.text += text
                out.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self.text_item,
                        output_index=self.text_index,
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
                )
            for tc in delta.get("tool_calls") or ():
                out.extend(self._call_delta(tc))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _call_delta(self, tc: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        k = int(tc.get("index", 0))
        fn = tc.get("function") or {}
        call = self.calls.get(k)
        if call is None:
            call = _Call(
                new_item_id("fc"), self.next_index, tc.get("id") or new_item_id("call"), fn.get("name") or ""
            )
            self.next_index += 1
            self.calls[k] = call
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=call.output_index,
                    item=call_item(call.item_id, call.call_id, call.name, "", "in_progress"),
                )
            )
        elif fn.get("name"):
            call.name += fn["name"]
        args = fn.get("arguments")
        if args:
            call.arguments += args
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item_id,
                    output_index=call.output_index,
                    delta=args,
                )
            )
        return out

    def finish(self) -> tuple[list[dict[str, Any]], Finished]:
        """The closing events (each item's done events, then the terminal one) and the whole answer."""
        out: list[dict[str, Any]] = []
        items: list[tuple[int, dict[str, Any]]] = []
        if self.text_item is not None:
            part = {"type": "output_text", "text": self.text, "annotations": []}
            common = {"item_id": self.text_item, "output_index": self.text_index, "content_index": 0}
            out.append(self._event("response.output_text.done", **common, text=self.text, logprobs=[]))
            out.append(self._event("response.content_part.done", **common, part=part))
            item = message_item(self.text_item, self.text)
            out.append(self._event("response.output_item.done", output_index=self.text_index, item=item))
            items.append((self.text_index, item))
        for call in self.calls.values():
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call.item_id,
                    output_index=call.output_index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            item = call_item(call.item_id, call.call_id, call.name, call.arguments)
            out.append(self._event("response.output_item.done", output_index=call.output_index, item=item))
            items.append((call.output_index, item))
        output = [item for _, item in sorted(items, key=lambda p: p[0])]
        if not output:
            output = [message_item(new_item_id("msg"), "")]
        status, reason = finish_status(self.finish_reason)
        body = self.shape.body(status, output, responses_usage(self.usage), incomplete=reason)
        out.append(
            self._event(
                "response.completed" if status == "completed" else "response.incomplete", response=body
            )
        )
        calls = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls.values()
        ]
        return out, Finished(body, assistant_message(self.text, calls), self.usage)

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        err = {"code": str(error.get("code") or "server_error"), "message": str(error.get("message") or "")}
        return [
            self._event(
                "response.failed", response=self.shape.body("failed", [], responses_usage(self.usage), err)
            )
        ]


def encode_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def not_found(response_id: str, *, expired: bool, param: str | None) -> APIError:
    if expired:
        message = f"The response '{response_id}' has expired; stored responses are kept for a limited time."
    else:
        message = f"No response with id '{response_id}' was found."
    return APIError(404, message, param=param, code="response_expired" if expired else "response_not_found")
