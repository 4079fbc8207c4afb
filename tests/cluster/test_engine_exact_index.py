"""Exact prefix index from our real engine's KV events: two supervised `tokenops engine` processes
with the bundled model, a prompt given as token ids, and the second request sharing its prefix routed
to the replica whose engine reported storing those blocks (and the engine confirms the cache hit);
then chat conversations through the real gateway, whose prompt tokeniser hashes the rendered messages
in the engine's token blocks, so each second turn goes to the replica holding its first."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenops.bench.ports import free_port
from tokenops.cluster.dispatch import Cluster, DispatchRequest
from tokenops.cluster.policies import PrefixAware
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.cluster.snapshot import RequestInfo
from tokenops.cluster.supervisor import Supervisor, engine_specs
from tokenops.config import load_settings

pytestmark = [pytest.mark.anyio, pytest.mark.bundled, pytest.mark.timeout(400)]


async def test_routing_follows_the_engines_kv_events() -> None:
    specs = engine_specs(
        [free_port(), free_port()], args=["--kv-cache-memory", "64MiB", "--log-level", "warning"]
    )
    sup = Supervisor(specs)
    await sup.start()
    cluster: Cluster | None = None
    try:
        await sup.wait_ready("/v1/load", timeout=300)
        policy = PrefixAware(learn=False)
        replicas = [ReplicaSpec(url=s.url, id=s.name, kind="tokenops") for s in specs]
        pool = ReplicaPool("smollm2-135m-instruct", replicas, policy)
        cluster = Cluster({pool.model: pool}, load_poll_interval=0.2)
        await cluster.start()

        async def complete(tokens: list[int]) -> tuple[str, dict]:
            info = RequestInfo(
                model=pool.model,
                block_hashes=tuple(block_hashes_from_tokens(tokens, 16)),
                prompt_tokens=len(tokens),
                max_tokens=2,
            )
            body = {"prompt": tokens, "max_tokens": 2, "temperature": 0}
            async with cluster.open(DispatchRequest(info, "/v1/completions", body)) as up:
                data = json.loads(await up.read())
            assert up.status == 200, data
            return up.replica, data

        shared = list(range(200, 264))  # four full blocks
        first, _ = await complete(shared + [7, 8, 9])
        hashes = block_hashes_from_tokens(shared, 16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while policy.index.match(hashes).get(first, 0) < 4:  # the engine's events reached the index
            assert loop.time() < deadline, "KV events never arrived"
            await asyncio.sleep(0.1)
        second, data = await complete(shared + [11, 12, 13])
        assert second == first
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the engine agrees
        # the other replica learnt nothing: the index is exactly what the engines reported
        other = next(s.name for s in specs if s.name != first)
        assert policy.index.match(hashes).get(other, 0) == 0
    finally:
        if cluster is not None:
            await cluster.aclose()
        await sup.stop()


# ---------------------------------------------------------------------------------------------
# Chat through the real gateway: its prompt tokeniser hashes the rendered conversation in the engine's
# token blocks, so the second turn finds the replica whose KV events hold the first turn.

SYSTEMS = [
    f"You are assistant number {i} of the {topic} desk. Answer in one short sentence, cite the manual, "
    + f"and never invent a {topic} policy that the manual does not state. " * 12
    for i, topic in enumerate(("billing", "shipping", "security"))
]


def start_gateway(settings: Any) -> tuple[Any, str, Callable[[], None]]:
    """The gateway app on a free loopback port, in a thread with its own event loop."""
    import uvicorn

    from tokenops.gateway.app import create_app

    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "gateway did not start"
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return app, f"http://127.0.0.1:{sock.getsockname()[1]}", stop


async def test_chat_second_turns_follow_the_engines_kv_events(tmp_path: Path) -> None:
    specs = engine_specs(
        [free_port(), free_port()], args=["--kv-cache-memory", "64MiB", "--log-level", "warning"]
    )
    sup = Supervisor(specs)
    await sup.start()
    stop: Callable[[], None] | None = None
    try:
        await sup.wait_ready("/v1/load", timeout=300)
        urls = [s.url + "/v1" for s in specs]
        settings = load_settings(
            None,
            environ={},
            overrides={
                "data_dir": tmp_path,
                "admin_key": "admin",
                # remote replicas of the bundled model: the `tokenizer` key names it for the gateway
                "models": {"smol": {"backends": urls, "served_name": "smollm2-135m-instruct",
                                    "tokenizer": "smollm2-135m-instruct"}},
                "cluster": {
                    "models": {"smol": {"policy": "prefix_aware", "policy_options": {"learn": False},
                                        "kinds": dict.fromkeys(urls, "tokenops")}},
                    "load_poll_interval_s": 0.2,
                },
            },
        )  # fmt: skip
        gateway, url, stop = await asyncio.to_thread(start_gateway, settings)
        pool = gateway.cluster.pools["smol"]
        tokenizer = pool.prompt_tokenizer
        assert tokenizer is not None and await asyncio.to_thread(tokenizer.wait, 120), tokenizer.error
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            admin = {"authorization": "Bearer admin"}
            await http.post("/admin/tenants", json={"parent": None, "name": "t"}, headers=admin)
            r = await http.post("/admin/keys", json={"node": "t", "name": "k", "limits": {}}, headers=admin)
            auth = {"authorization": f"Bearer {r.json()['key']}"}

            async def chat(messages: list[dict]) -> tuple[str, str, dict, list[int]]:
                """(replica, reason, response, block hashes of the gateway's prompt ids) of one greedy
                chat."""
                before = dict(pool.picks)
                body = {"model": "smol", "messages": messages, "max_tokens": 4, "temperature": 0}
                r = await http.post("/v1/chat/completions", json=body, headers=auth)
                assert r.status_code == 200, r.text
                ((replica, reason),) = [k for k, n in pool.picks.items() if n > before.get(k, 0)]
                ids = tokenizer.chat_ids(body)
                assert ids is not None and r.json()["usage"]["prompt_tokens"] == len(
                    ids
                )  # as many as the engine's
                return replica, reason, r.json(), block_hashes_from_tokens(ids, 16)

            firsts = []
            for system in SYSTEMS:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]
                replica, reason, resp, hashes = await chat(messages)
                assert reason.startswith("prefix-miss") and len(hashes) > 10
                messages.append({"role": "assistant", "content": resp["choices"][0]["message"]["content"]})
                firsts.append((replica, messages, hashes))
                # the engine's KV events reach the index and name every full block of the gateway's ids,
                # on that replica only
                deadline = time.monotonic() + 30
                while pool.policy.index.match(hashes).get(replica, 0) < len(hashes):
                    assert time.monotonic() < deadline, (
                        "the engine's KV events never matched the gateway's blocks"
                    )
                    await asyncio.sleep(0.1)
                assert set(pool.policy.index.match(hashes)) == {replica}

            for replica, messages, hashes in firsts:
                messages.append({"role": "user", "content": "And what does the manual say about refunds?"})
                second, reason, resp, _ = await chat(messages)
                assert second == replica and reason.startswith("prefix-hit")
                # the engine agrees: every full block of the first turn came from its prefix cache
                assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * len(hashes)
    finally:
        if stop is not None:
            await asyncio.to_thread(stop)
        await sup.stop()
