"""What a cached answer may be reused for: the hard scope of a request and the key of its last message.

This module owns the split of a chat or text-completion request into (1) a scope hash: everything
that can change the answer other than the last message: tenant, model or route, the whole conversation
before the last message (system prompt included), tools, response format and every sampling parameter;
entries live under their scope only and are never compared across scopes; (2) the exact key: the
scope plus the last message's canonical JSON; (3) the text the semantic layer may embed: the last
message's plain text, only when it is a chat user message made of text alone (a text completion's
prompt is matched exactly or not at all). It also decides the
bypasses (client directives, sampled requests without an opt-in). It does not embed, search or store.

Fields are put in the scope by default: only the ones listed in `NOT_IN_SCOPE` (transport and
bookkeeping: stream, stream_options, user, ...) are left out, so an unknown or future parameter
splits the scope rather than risking a wrong answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

Kind = Literal["chat", "completion"]

# request fields that never change the answer's content: transport, accounting, tracing
NOT_IN_SCOPE = frozenset(
    {
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "priority",
        "service_tier",
        "cache",
        "messages",
        "prompt",
    }
)


class RequestLike(Protocol):
    """What the cache reads from a request: `tokenops.gateway.request.InboundRequest` fits."""

    kind: Kind
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BodyRequest:
    """A request given as its kind and JSON body (tests, benchmarks, admin tools)."""

    kind: Kind
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Who asks and for what: the caller's tenant and the model or route name the client asked for."""

    tenant: str
    model: str


@dataclass(frozen=True, slots=True)
class CacheDirective:
    """The client's instructions for this request (from headers; see `directive_from_headers`)."""

    lookup: bool = True  # False: Cache-Control: no-cache (do not serve from the cache, still store)
    store: bool = True  # False: Cache-Control: no-store
    allow_sampled: bool = False  # the request opts in to caching although it samples (temperature > 0)


def directive_from_headers(cache_control: str | None, tokenops_cache: str | None = None) -> CacheDirective:
    """`Cache-Control: no-cache | no-store` and `x-tokenops-cache: off | sampled` as a directive."""
    cc = {p.strip().lower() for p in (cache_control or "").split(",") if p.strip()}
    opt = {p.strip().lower() for p in (tokenops_cache or "").split(",") if p.strip()}
    off = "off" in opt or "bypass" in opt
    no_store = "no-store" in cc or off
    return CacheDirective(
        lookup=not (no_store or "no-cache" in cc or "off" in opt),
        store=not no_store,
        allow_sampled="sampled" in opt,
    )


def digest(*parts: Any) -> str:
    """A 128-bit hash of JSON-serialisable parts (keys sorted, so dict order does not matter)."""
    raw = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class CacheQuery:
    """One request as the cache sees it."""

    tenant: str
    scope_hash: str
    exact_key: str
    text: str | None  # the last user message's text, when the semantic layer may use it
    bypass: str | None  # why the cache must not serve this request (None: it may)
    store_ok: bool  # whether its answer may be stored


def _text_only(content: Any) -> str | None:
    """A message's text when it has nothing but text (a string or text parts), else None."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "".join(p["text"] for p in content)
    return None


def _temperature(body: dict[str, Any], default: float) -> float:
    t = body.get("temperature")
    try:
        return default if t is None else float(t)
    except (TypeError, ValueError):
        return default


def build_query(
    scope: CacheScope,
    request: RequestLike,
    directive: CacheDirective,
    *,
    default_temperature: float,
    sampled_tenants: frozenset[str] = frozenset(),
) -> CacheQuery:
    """Scope hash, exact key, embeddable text and bypass decision for one request."""
    body = request.body
    if _temperature(body, default_temperature) > 0 and not (
        directive.allow_sampled or scope.tenant in sampled_tenants
    ):
        # neither looked up nor stored: skip the hashing (most traffic samples; it must cost nothing here)
        return CacheQuery(scope.tenant, "", "", None, "sampled", False)
    params = {k: v for k, v in body.items() if k not in NOT_IN_SCOPE}
    params["model"] = scope.model  # the name the client asked for (a route), not what served it
    text: str | None = None
    if request.kind == "chat":
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not messages:
            return CacheQuery(scope.tenant, "", "", None, "unparsable", False)
        history, last = messages[:-1], messages[-1]
        if isinstance(last, dict) and last.get("role") == "user":
            text = _text_only(last.get("content"))
    else:
        # a text completion continues its prompt verbatim: a reworded prompt needs another
        # continuation, so these are cached by the exact layer only
        history, last = [], body.get("prompt")
    scope_hash = digest("scope/v1", scope.tenant, request.kind, params, history)
    exact_key = digest("exact/v1", scope_hash, last)

    bypass = None if directive.lookup else "client_no_cache"
    store_ok = directive.store
    if text is not None and not text.strip():
        text = None
    return CacheQuery(scope.tenant, scope_hash, exact_key, text, bypass, store_ok)
