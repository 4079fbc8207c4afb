"""The gateway in front of two real vLLM replicas (CPU build): chat and completions, streaming with usage,
vLLM's prefix-cache hits metered as cached input, vLLM's errors as OpenAI errors, a client that goes away
aborting the request inside vLLM, the load poller on vLLM's real /metrics, and the exact prefix index fed
by vLLM's real KV events placing each conversation's next turn on the replica that holds it."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from conftest import BLOCK, MODEL, SERVED
from tokenops.bench.vllm_process import VLLMServer
from tokenops.cluster.load_poller import LoadPoller, parse_prometheus_load
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import block_hashes_from_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MANUAL = (
    "You are the support assistant of a lighthouse museum. The museum opens at nine and closes at five. "
    "Tickets cost twelve euros, children under six enter free, and guided tours start every hour. "
    "The tower has 217 steps; visitors with reduced mobility can see the lens room by lift. "
)


def metrics(server: VLLMServer) -> dict[str, float]:
    """vLLM's /metrics summed over label sets, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def idle(servers: list[VLLMServer], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(metrics(s).get("vllm:num_requests_running", 0) for s in servers):
        assert time.monotonic() < deadline, "vLLM still runs requests"
        time.sleep(0.2)


def test_chat_and_completions_are_metered_as_vllm_counted_them(gateway, vllm_replicas) -> None:
    client = gateway.client(gateway.new_key("basic"), timeout=300)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert chat.model and chat.choices[0].message.content and chat.usage.completion_tokens >= 1
    comp = client.completions.create(
        model=MODEL,
        prompt="The lighthouse keeper",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert comp.choices[0].text and comp.usage.completion_tokens == 6
    rows = gateway.wait_ledger(2, key_id=_key_id(gateway, "basic"))
    metered = [(r["uncached_input_tokens"] + r["cached_input_tokens"], r["output_tokens"]) for r in rows]
    assert metered == [
        (chat.usage.prompt_tokens, chat.usage.completion_tokens),
        (comp.usage.prompt_tokens, 6),
    ]
    assert all(r["status"] == "ok" for r in rows)


def test_streaming_carries_vllms_usage_into_the_ledger(gateway) -> None:
    client = gateway.client(gateway.new_key("stream"), timeout=300)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and usage is not None and usage.completion_tokens == 12
    (row,) = gateway.wait_ledger(1, key_id=_key_id(gateway, "stream"))
    assert row["output_tokens"] == 12
    assert row["uncached_input_tokens"] + row["cached_input_tokens"] == usage.prompt_tokens


def _key_id(gateway, name: str) -> str:
    return next(k["id"] for k in gateway.admin("GET", "/admin/keys").json()["data"] if k["name"] == name)


def test_vllm_prefix_cache_hits_are_metered_as_cached_input(gateway) -> None:
    client = gateway.client(gateway.new_key("cached"), timeout=300)
    messages = [{"role": "system", "content": MANUAL * 2}, {"role": "user", "content": "When do you open?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    # the index is exact, so as fresh as vLLM's event stream: the repeat goes out once it names the blocks
    pool = gateway.app.cluster.pools[MODEL]
    ids = pool.prompt_tokenizer.chat_ids({"model": MODEL, "messages": messages, "max_tokens": 4})
    hashes = block_hashes_from_tokens(ids, BLOCK)
    deadline = time.monotonic() + 30
    while max(pool.policy.index.match(hashes).values(), default=0) < len(hashes):
        assert time.monotonic() < deadline, "vLLM's KV events never named the prompt's blocks"
        time.sleep(0.05)
    # an exact repeat at temperature 0 is the gateway's own response cache's to answer (no backend
    # call, ledger status cache_hit); no-cache sends it on to vLLM, whose prefix cache serves it
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_headers={"cache-control": "no-cache"},
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the prefix router sends the repeat to the replica that computed it: all full blocks are hits
    assert cached >= BLOCK * ((first.usage.prompt_tokens - 1) // BLOCK)
    rows = gateway.wait_ledger(2, key_id=_key_id(gateway, "cached"))
    assert [r["cached_input_tokens"] for r in rows] == [
        first.usage.prompt_tokens_details.cached_tokens or 0,
        cached,
    ]
    assert rows[1]["uncached_input_tokens"] == second.usage.prompt_tokens - cached
    assert rows[1]["cost_micros"] < rows[0]["cost_micros"]  # cached input is priced at half


def test_vllm_errors_reach_the_client_as_openai_errors(gateway) -> None:
    client = gateway.client(gateway.new_key("errors"), timeout=300)
    with pytest.raises(openai.BadRequestError) as err:
        # the gateway passes the body on; vLLM refuses min_tokens above max_tokens
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"min_tokens": 50}, temperature=0
        )
    body = err.value.body
    assert err.value.status_code == 400 and isinstance(body, dict)
    assert body.get("message") and body.get("type")


def test_a_client_gone_aborts_the_request_inside_vllm(gateway, vllm_replicas) -> None:
    idle(vllm_replicas)
    before = sum(metrics(s).get("vllm:generation_tokens_total", 0) for s in vllm_replicas)
    client = gateway.client(gateway.new_key("gone"), timeout=300)
    stream = client.completions.create(
        model=MODEL,
        prompt="Write a very long story about the sea.",
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for _chunk in stream:
        got += 1
        if got == 3:
            break
    running = max(metrics(s).get("vllm:num_requests_running", 0) for s in vllm_replicas)
    stream.close()
    # the request leaves vLLM's running set because the gateway closed its upstream stream and vLLM
    # aborted it, long before its 3,000 tokens
    idle(vllm_replicas, timeout=30)
    generated = sum(metrics(s).get("vllm:generation_tokens_total", 0) for s in vllm_replicas) - before
    assert running >= 1 and generated < 3000


@pytest.mark.anyio
async def test_the_load_poller_reads_vllms_real_metrics(vllm_replicas) -> None:
    server = vllm_replicas[0]
    prompt = MANUAL * 3
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        await client.completions.create(model=SERVED, prompt=prompt, max_tokens=1)  # fills the cache
        # a long request, so that the poll sees it running
        task = asyncio.create_task(
            client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=400, extra_body={"ignore_eos": True}
            )
        )
        pool = ReplicaPool("m", [ReplicaSpec(url=server.url + "/v1", id="v", kind="vllm")], _policy())
        poller = LoadPoller([pool], timeout=5)
        async with httpx.AsyncClient() as http:
            deadline = time.monotonic() + 120
            while True:
                await poller.poll_once(http)
                load = pool.replicas["v"].reported
                if load is not None and load.running >= 1:
                    break
                assert time.monotonic() < deadline, "the poller never saw the request running"
                await asyncio.sleep(0.1)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, openai.APIError):
            pass
    assert load.waiting == 0 and 0 < load.kv_usage < 1
    assert load.prefix_cache_hits > 0 and load.prefix_cache_queries >= load.prefix_cache_hits
    # the same names the parser reads, as this vLLM version exports them
    text = httpx.get(server.url + "/metrics").text
    parsed = parse_prometheus_load(text, "vllm", 0.0)
    assert parsed.prefix_cache_queries >= load.prefix_cache_queries
    idle(vllm_replicas)


def _policy():  # type: ignore[no-untyped-def]
    from tokenops.cluster.policies import PrefixAware

    return PrefixAware()


def test_vllm_kv_events_place_each_conversation_on_the_replica_holding_it(gateway, vllm_replicas) -> None:
    pool = gateway.app.cluster.pools[MODEL]
    tokenizer = pool.prompt_tokenizer
    assert pool.policy.learn is False  # exact mode: vLLM's KV events are the only source of the index
    client = gateway.client(gateway.new_key("placement"), timeout=300)
    # distinct from their first block on, so each first turn is a miss and the misses spread
    systems = [f"Branch {i} of the museum, the harbour wing. " * (2 + i) + MANUAL for i in range(4)]
    firsts = []
    for system in systems:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]
        before = dict(pool.picks)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        ((replica, reason),) = [k for k, n in pool.picks.items() if n > before.get(k, 0)]
        ids = tokenizer.chat_ids({"model": MODEL, "messages": messages, "max_tokens": 4})
        assert ids is not None and len(ids) == r.usage.prompt_tokens  # the gateway tokenises as vLLM does
        hashes = block_hashes_from_tokens(ids, BLOCK)
        # vLLM's events arrive over ZeroMQ and name every full block of the gateway's ids, on that
        # replica only
        deadline = time.monotonic() + 30
        while pool.policy.index.match(hashes).get(replica, 0) < len(hashes):
            assert time.monotonic() < deadline, f"vLLM's KV events never matched ({reason})"
            time.sleep(0.1)
        assert set(pool.policy.index.match(hashes)) == {replica}
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        firsts.append((replica, messages, hashes))
    assert len({f[0] for f in firsts}) == 2  # the misses were balanced over both replicas

    for replica, messages, hashes in firsts:
        messages.append({"role": "user", "content": "And what do tickets cost?"})
        before = dict(pool.picks)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        ((second, reason),) = [k for k, n in pool.picks.items() if n > before.get(k, 0)]
        assert second == replica and reason.startswith("prefix-hit")
        # vLLM agrees: every full block of the first turn came from its prefix cache
        assert r.usage.prompt_tokens_details.cached_tokens >= BLOCK * len(hashes)
