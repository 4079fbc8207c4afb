"""The scope hash splits on everything that changes the answer and ignores transport fields; the
directives and the sampled-request rule decide bypasses."""

from __future__ import annotations

from tokenops.cache import BodyRequest, CacheDirective, CacheScope, directive_from_headers
from tokenops.cache.scope import build_query

from .conftest import SCOPE, chat


def q(request, scope=SCOPE, directive=None, sampled=frozenset()):
    return build_query(
        scope, request, directive or CacheDirective(), default_temperature=1.0, sampled_tenants=sampled
    )


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def test_scope_splits_on_what_changes_the_answer():
    base = q(chat("hello"))
    variants = [
        q(chat("hello"), scope=CacheScope("other", "m")),
        q(chat("hello"), scope=CacheScope("acme", "auto")),
        q(chat("hello", system="You are a pirate.")),
        q(chat("hello", system=None)),
        q(chat("hello", history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])),
        q(chat("hello", tools=TOOLS)),
        q(chat("hello", max_tokens=5)),
        q(chat("hello", top_p=0.5)),
        q(chat("hello", stop=["\n"])),
        q(chat("hello", seed=7)),
        q(chat("hello", n=2)),
        q(chat("hello", logprobs=True)),
        q(chat("hello", response_format={"type": "json_object"})),
        q(chat("hello", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}}})),
        q(chat("hello", response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {}}})),
        q(chat("hello", tools=TOOLS, tool_choice="required")),
        q(chat("hello", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})),
        q(chat("hello", tools=TOOLS, parallel_tool_calls=False)),
        q(chat("hello", some_future_param=1)),  # unknown fields split too
        q(BodyRequest("completion", {"model": "m", "prompt": "hello", "temperature": 0})),
    ]
    hashes = {v.scope_hash for v in variants}
    assert base.scope_hash not in hashes and len(hashes) == len(variants)


def test_transport_fields_do_not_split():
    base = q(chat("hello"))
    same = [
        q(chat("hello", stream=True, stream_options={"include_usage": True})),
        q(chat("hello", user="alice")),
        q(chat("hello", metadata={"trace": "x"})),
    ]
    assert {s.scope_hash for s in same} == {base.scope_hash}
    assert {s.exact_key for s in same} == {base.exact_key}


def test_key_order_does_not_matter():
    a = BodyRequest(
        "chat", {"model": "m", "temperature": 0, "top_p": 0.9, "messages": [{"role": "user", "content": "x"}]}
    )
    b = BodyRequest(
        "chat", {"messages": [{"content": "x", "role": "user"}], "top_p": 0.9, "temperature": 0, "model": "m"}
    )
    assert q(a).exact_key == q(b).exact_key


def test_semantic_text_only_for_plain_user_text():
    assert q(chat("hello")).text == "hello"
    parts = chat("x")
    parts.body["messages"][-1]["content"] = [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]
    assert q(parts).text == "hello"
    image = chat("x")
    image.body["messages"][-1]["content"] = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:"}},
    ]
    assert q(image).text is None  # an image must never be matched by its caption alone
    tool = chat("x")
    tool.body["messages"][-1] = {"role": "tool", "tool_call_id": "1", "content": "42"}
    assert q(tool).text is None
    assert q(BodyRequest("completion", {"model": "m", "prompt": [1, 2, 3], "temperature": 0})).text is None
    assert q(BodyRequest("completion", {"model": "m", "prompt": "Once upon", "temperature": 0})).text is None


def test_sampled_requests_bypass_unless_opted_in():
    assert q(chat("hi", temperature=0.7)).bypass == "sampled"
    omitted = chat("hi")
    del omitted.body["temperature"]
    assert q(omitted).bypass == "sampled"  # the backend's default temperature (1.0) samples
    assert q(chat("hi", temperature=0)).bypass is None
    assert q(chat("hi", temperature=0.7), directive=CacheDirective(allow_sampled=True)).bypass is None
    assert q(chat("hi", temperature=0.7), sampled=frozenset({"acme"})).bypass is None
    assert not q(chat("hi", temperature=0.7)).store_ok


def test_directives_from_headers():
    assert directive_from_headers(None) == CacheDirective()
    d = directive_from_headers("no-cache")
    assert not d.lookup and d.store
    d = directive_from_headers("max-age=0, no-store")
    assert not d.lookup and not d.store
    assert directive_from_headers(None, "sampled").allow_sampled
    d = directive_from_headers(None, "off")
    assert not d.lookup and not d.store
    assert q(chat("hi"), directive=directive_from_headers("no-cache")).bypass == "client_no_cache"
