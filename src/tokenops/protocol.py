"""OpenAI wire types and errors, shared by the gateway, the engine server and the bench.

This module owns the shape of requests, responses, usage and errors as they cross HTTP. It does not
decide anything (limits, routing, sampling): it parses, validates and renders. Every refusal in the
platform is an `APIError`, rendered as OpenAI's `{"error": {...}}` body with a message that says
what to change.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# ---------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """A refusal with an HTTP status and an OpenAI-format body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, available: list[str]) -> APIError:
    names = ", ".join(sorted(available)) or "none"
    return APIError(
        404,
        f"The model '{model}' does not exist. Available models: {names}.",
        code="model_not_found",
        param="model",
    )


def context_length_exceeded(
    prompt_tokens: int,
    max_tokens: int | None,
    window: int,
    *,
    at_least: bool = False,
    param: str = "messages",
) -> APIError:
    """`at_least`: the prompt's count is a lower bound (a gateway counts without the tokenizer)."""
    asked = f"{'at least ' if at_least else ''}{prompt_tokens} tokens in the prompt"
    if max_tokens:
        asked += f" plus {max_tokens} requested completion tokens"
    return APIError(
        400,
        f"This model's maximum context length is {window} tokens, but {asked} were asked for. "
        "Shorten the messages or lower max_tokens.",
        code="context_length_exceeded",
        param=param,
    )


def from_validation_error(exc: ValidationError) -> APIError:
    """Turn pydantic's report into one clear sentence naming the first bad field."""
    err = exc.errors()[0]
    # a union's members appear in the path by type name (`content.str`): the field is what matters
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _is_type_tag(p))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return invalid_request(
            f"Missing required parameter: '{loc}'.", param=loc, code="missing_required_parameter"
        )
    if str(err.get("type", "")).endswith("_type") and "input" in err:
        msg += f", not {_json_type(err['input'])}"  # strict types: say what came instead
    return invalid_request(f"Invalid value for '{loc}': {msg}.", param=loc or None)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)


def _json_type(value: Any) -> str:
    for typ, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, typ):
            return name
    return "null"


# ---------------------------------------------------------------------------------------------
# Requests


# Requests are validated strictly, as OpenAI's schema types them: a boolean is not an integer
# (`max_tokens: true`), a string is not a boolean (`stream: "yes"`), a float is not an integer.
STRICT = ConfigDict(extra="allow", strict=True)

# the content part types of a chat message, and the field each must carry with its JSON type
CONTENT_PARTS: dict[str, tuple[str, type]] = {
    "text": ("text", str),
    "input_text": ("text", str),
    "refusal": ("refusal", str),
    "image_url": ("image_url", dict),
    "input_audio": ("input_audio", dict),
    "file": ("file", dict),
}
_JSON_TYPE = {str: "a string", dict: "an object"}


def check_content_parts(parts: list[dict[str, Any]]) -> None:
    """Every part names a known type and carries that type's field (an image part its URL)."""
    for i, part in enumerate(parts):
        kind = part.get("type")
        if kind not in CONTENT_PARTS:
            known = ", ".join(f"'{k}'" for k in CONTENT_PARTS)
            raise ValueError(f"content part {i} has type {kind!r}; the type must be one of {known}")
        key, typ = CONTENT_PARTS[kind]
        value = part.get(key)
        if not isinstance(value, typ):
            raise ValueError(f"content part {i} of type '{kind}' needs '{key}' as {_JSON_TYPE[typ]}")
        if kind == "image_url" and not isinstance(value.get("url"), str):
            raise ValueError(f"content part {i} of type 'image_url' needs 'image_url.url' as a string")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # content may be a string, None (assistant with tool calls) or a list of typed parts
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(v, list):
            check_content_parts(v)
        return v

    def text(self) -> str:
        """The message's text; list-of-parts content is joined from its text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") in ("text", "input_text"))


class SamplingFields(BaseModel):
    """Fields common to chat and text completions."""

    model_config = STRICT

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    ignore_eos: bool = False
    # thinking budget in tokens (reasoning models); OpenAI's reasoning_effort maps to one per engine
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    reasoning_effort: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit():
                raise ValueError(f"the key {token!r} is not a token id (a string of digits)")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {token} is {bias}; it must be within [-100, 100]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables (vLLM's field)
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or ()):
            fn = tool.get("function")
            named = isinstance(fn, dict) and isinstance(fn.get("name"), str)
            if tool.get("type") != "function" or not named:
                raise ValueError(
                    f"tool {i} must be {{'type': 'function', 'function': {{'name': <string>, ...}}}}"
                )
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
        return v

    @model_validator(mode="after")
    def _fold_max_completion_tokens(self) -> ChatCompletionRequest:
        # OpenAI's newer name wins when both are given
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self


MAX_TOKEN_ID = 2**31  # above any vocabulary; keeps ids within what hashing and the engine take


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and not isinstance(v[0], str):
            rows = v if isinstance(v[0], list) else [v]
            if any(not 0 <= t < MAX_TOKEN_ID for row in rows for t in row):
                raise ValueError(f"prompt token ids must be integers in [0, {MAX_TOKEN_ID})")
        return v


# ---------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details else 0

    @property
    def reasoning_tokens(self) -> int:
        return self.completion_tokens_details.reasoning_tokens if self.completion_tokens_details else 0


def make_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
