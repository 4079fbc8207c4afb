"""Prefill/decode disaggregation between two real engine servers on loopback: the prefill leg holds
the prompt's blocks, the decode leg pulls them over the binary stream, and greedy output equals the
colocated engine's token for token; blocks are byte-exact per KV dtype; bad or stale handles give a
400 or a local prefill, never a wrong answer; holds expire and are counted."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiny_server import ByteTokenizer, start_server
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.kv_transfer import (
    KVLayout,
    KVTransferError,
    export_block,
    import_block,
    pull_blocks,
    release_hold,
)

MODEL = "tiny-pd"
PROMPT = "the tide comes in and the tide goes out, " * 3  # 123 byte tokens: 30 full blocks of 4


def _engine_pair(tiny_llama, **kw):
    servers = []
    for role in ("prefill", "decode"):
        engine, app, ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL, **kw)
        app.state.server.config.role = role
        servers.append((engine, app, ctx))
    return servers


def _complete(url: str, prompt, max_tokens: int, kv=None, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _pd(p_url: str, d_url: str, prompt, max_tokens: int, prefill_kv=None) -> tuple[dict, dict]:
    first = _complete(p_url, prompt, 1, prefill_kv or {"do_remote_decode": True})
    assert first.status_code == 200, first.text
    handle = first.json()["kv_transfer_params"]
    second = _complete(d_url, prompt, max_tokens, handle)
    assert second.status_code == 200, second.text
    return first.json(), second.json()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_prefill_then_decode_equals_colocated_greedy(tiny_llama, kv_dtype):
    (p_engine, p_app, p_ctx), (d_engine, d_app, d_ctx) = _engine_pair(tiny_llama, kv_cache_dtype=kv_dtype)
    _, _, solo_ctx = start_server(
        copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL, kv_cache_dtype=kv_dtype
    )
    with p_ctx as p_url, d_ctx as d_url, solo_ctx as solo_url:
        oracle = _complete(solo_url, PROMPT, 24).json()
        prefill, decode = _pd(p_url, d_url, PROMPT, 24)
        handle = prefill["kv_transfer_params"]
        assert handle["do_remote_prefill"] is True and handle["remote_engine_id"]
        assert len(handle["remote_block_ids"]) == len(ByteTokenizer().encode(PROMPT)) // 4
        assert decode["choices"][0]["text"] == oracle["choices"][0]["text"]
        report = decode["kv_transfer"]
        assert report["fallback"] is None and report["blocks"] == len(handle["remote_block_ids"])
        assert report["bytes"] == report["blocks"] * 4 * d_engine.kv_bytes_per_token
        sources = decode["usage"]["prompt_token_sources"]
        assert sources["transferred"] == report["blocks"] * 4 and sources["local_cache"] == 0
        assert sources["computed"] == decode["usage"]["prompt_tokens"] - sources["transferred"]
        # the decode engine acknowledged the blocks: the prefill engine released its hold
        deadline = time.monotonic() + 10
        while len(p_engine.kv_holds) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(p_engine.kv_holds) == 0 and p_engine.transfer_stats.holds_released == 1
        p_engine.pool.check_invariants()
        # the same handle again is stale: the decode engine prefills locally and is still right
        again = _complete(d_url, PROMPT + "x", 8, handle).json()
        assert again["kv_transfer"]["fallback"] == "unknown_transfer" and again["choices"][0]["text"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_block_bytes_round_trip_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    src = allocate_kv_caches(2, 6, 4, 2, 16, dtype)
    dst = allocate_kv_caches(2, 6, 4, 2, 16, dtype)
    for k, v in src:
        for cache in (k, v):
            parts = (cache.data, cache.scale) if dtype == torch.int8 else (cache,)
            for t in parts:
                if t.dtype == torch.int8:
                    t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
                else:
                    t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    payload = export_block(src, 3)
    import_block(dst, 5, payload)
    assert export_block(dst, 5) == payload
    per_token = len(payload) // 4
    assert per_token == {torch.float32: 512, torch.bfloat16: 256, torch.int8: 2 * 2 * 2 * (16 + 2)}[dtype]
    with pytest.raises(ValueError):
        import_block(dst, 5, payload + b"\0")


def test_bad_and_stale_kv_transfer_params(tiny_llama):
    (p_engine, _, p_ctx), (d_engine, _, d_ctx) = _engine_pair(tiny_llama)
    with p_ctx as p_url, d_ctx as d_url:
        for bad, field in (
            ("yes", "kv_transfer_params"),
            ({"do_remote_decode": "1"}, "kv_transfer_params.do_remote_decode"),
            (
                {
                    "do_remote_prefill": True,
                    "remote_block_ids": [1],
                    "remote_engine_id": "e",
                    "remote_host": "h",
                    "remote_port": 99999,
                    "remote_request_id": "r",
                },
                "kv_transfer_params.remote_port",
            ),
            ({"do_remote_prefill": True, "remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids"),
        ):
            r = _complete(d_url, PROMPT, 4, bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        # roles: a decode engine takes no prefill legs, a prefill engine no decode legs
        r = _complete(d_url, PROMPT, 1, {"do_remote_decode": True})
        assert r.status_code == 400 and "role decode" in r.json()["error"]["message"]
        r = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}, stream=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        oracle = _complete(d_url, PROMPT, 12).json()["choices"][0]["text"]
        handle = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}).json()["kv_transfer_params"]
        stale = [
            {**handle, "remote_request_id": "no-such-transfer"},
            {**handle, "remote_engine_id": "another-engine"},
            {**handle, "remote_block_ids": [b + 1000 for b in handle["remote_block_ids"]]},
            {**handle, "remote_port": _closed_port()},
        ]
        reasons = set()
        for h in stale:
            d_engine.pool.reset_prefix_cache()
            out = _complete(d_url, PROMPT, 12, h).json()
            assert out["choices"][0]["text"] == oracle  # local prefill: still the right answer
            assert out["usage"]["prompt_token_sources"]["transferred"] == 0
            reasons.add(out["kv_transfer"]["fallback"])
        assert reasons == {"unknown_transfer", "foreign_blocks", "peer_failed"}
        # the decode engine that prefilled instead released the hold its pull found (the foreign
        # block ids' one) rather than leave it pinned until its timeout
        deadline = time.monotonic() + 10
        while len(p_engine.kv_holds) and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = p_engine.transfer_stats
        assert (stats.holds_cancelled, stats.holds_expired, len(p_engine.kv_holds)) == (1, 0, 0)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{d_url}/metrics").text)}
        fallbacks = {
            s.labels["reason"]: s.value for s in families["tokenops_engine_kv_transfer_fallbacks"].samples
        }
        assert sum(fallbacks.values()) == 4
        d_engine.pool.check_invariants()


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unpulled_hold_expires_and_is_counted(tiny_llama):
    (p_engine, _, p_ctx), _ = _engine_pair(tiny_llama, kv_hold_timeout_s=0.2)
    with p_ctx as p_url:
        handle = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}).json()["kv_transfer_params"]
        assert handle["remote_block_ids"]
        deadline = time.monotonic() + 10
        while p_engine.transfer_stats.holds_expired == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p_engine.transfer_stats.holds_expired == 1 and len(p_engine.kv_holds) == 0
        text = httpx.get(f"{p_url}/metrics").text
        assert "tokenops_engine_kv_transfer_holds_expired_total" in text
        p_engine.pool.check_invariants()
        assert p_engine.pool.num_used_blocks == 0


def test_a_pull_of_held_blocks_does_not_wait_for_the_prefill_engines_step(tiny_llama):
    """The KV server begins a pull of held blocks at once: a prefill engine inside a long step (here a
    call that blocks its thread) still serves it, so a decode leg never waits for the next prefill."""
    (_, p_app, p_ctx), _ = _engine_pair(tiny_llama)
    with p_ctx as p_url:
        handle = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}).json()["kv_transfer_params"]
        server = p_app.state.server
        inside, leave, left = threading.Event(), threading.Event(), threading.Event()

        def long_step(_engine) -> None:
            inside.set()
            leave.wait(30)
            left.set()

        async def run() -> None:
            blocked = asyncio.ensure_future(server.engine.call(long_step))
            assert await asyncio.to_thread(inside.wait, 10)
            pulled = await pull_blocks(
                handle["remote_host"],
                handle["remote_port"],
                layout=server.kv.server.layout,
                engine_id=handle["remote_engine_id"],
                transfer_id=handle["remote_request_id"],
                block_ids=handle["remote_block_ids"],
                timeout_s=20,  # less than the engine thread's block: a pull that waited for it fails
            )
            assert not left.is_set()  # served while the engine thread was still busy
            assert len(pulled.hashes) == len(handle["remote_block_ids"]) > 0
            leave.set()
            await blocked

        asyncio.run(run())


def test_cut_stream_registers_nothing(tiny_llama):
    """A peer that closes the stream mid-way: the pull raises, and nothing reaches the pool."""
    layout = KVLayout("m", "float32", 4, 2, 2, 16)

    async def run() -> None:
        async def half(reader, writer):
            await reader.read(64)
            writer.write(
                b"TKV1\x00\x00\x01e" + (3).to_bytes(4, "big") + (512 * 4).to_bytes(4, "big") + b"\0" * 100
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(half, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        with pytest.raises(KVTransferError) as err:
            await pull_blocks("127.0.0.1", port, layout=layout, engine_id="", hashes=[1, 2, 3], timeout_s=5)
        assert err.value.reason == "peer_failed"
        server.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("count", "nbytes", "reason"), [(3, 512 * 5, "layout_mismatch"), (4, 512 * 4, "protocol")]
)
def test_a_peer_announcing_other_blocks_is_refused_before_they_are_read(count, nbytes, reason):
    """A peer that names our layout but announces blocks of another size, or more blocks than were
    asked for, is refused on its header: nothing of a claimed size is read or allocated."""

    layout = KVLayout("m", "float32", 4, 2, 2, 16)

    async def run() -> None:
        async def liar(reader, writer):
            await reader.read(64)
            header = b"TKV1\x00\x00\x01e" + count.to_bytes(4, "big") + nbytes.to_bytes(4, "big")
            writer.write(header + b"\0" * 64)
            await writer.drain()
            await asyncio.sleep(5)  # holds the stream open: a reader that waited for the bytes times out
            writer.close()

        server = await asyncio.start_server(liar, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(KVTransferError) as err:
            await pull_blocks(
                "127.0.0.1",
                port,
                layout=layout,
                engine_id="",
                hashes=[1, 2, 3],
                timeout_s=2,
                block_bytes=512 * 4,
            )
        assert err.value.reason == reason
        server.close()

    asyncio.run(run())


def test_incremental_rounds_ship_only_the_new_blocks(tiny_llama):
    """Round 2 of a session: the prefill engine pulls the history it lacks from the decode engine
    (by hash), and the decode engine pulls back only the blocks of the new turn."""
    (p_engine, _, p_ctx), (d_engine, _, d_ctx) = _engine_pair(tiny_llama)
    _, _, solo_ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
    with p_ctx as p_url, d_ctx as d_url, solo_ctx as solo_url:
        _, round1 = _pd(p_url, d_url, PROMPT, 16)
        history = PROMPT + round1["choices"][0]["text"] + " and then the tool said: the sea is calm. "
        deadline = time.monotonic() + 10
        while len(p_engine.kv_holds) and time.monotonic() < deadline:
            time.sleep(0.05)
        p_engine.pool.reset_prefix_cache()  # the prefill engine forgot round 1: it pulls the history
        load = httpx.get(f"{d_url}/v1/load").json()["kv_transfer"]
        src = {
            "remote_engine_id": load["engine_id"],
            "remote_host": load["host"],
            "remote_port": load["port"],
        }
        prefill, decode = _pd(p_url, d_url, history, 16, {"do_remote_decode": True, "history": src})
        oracle = _complete(solo_url, history, 16).json()
        assert decode["choices"][0]["text"] == oracle["choices"][0]["text"]
        pulled_history = prefill["kv_transfer"]["blocks"]
        assert pulled_history >= len(ByteTokenizer().encode(PROMPT)) // 4  # round 1's prompt at least
        assert prefill["usage"]["prompt_token_sources"]["transferred"] == pulled_history * 4
        total = len(prefill["kv_transfer_params"]["remote_block_ids"])
        # D already had the history: it pulled only the blocks it lacked
        assert 0 < decode["kv_transfer"]["blocks"] < total
        assert decode["usage"]["prompt_token_sources"]["local_cache"] > 0


def _exported(tiny_llama, prompt: list[int]) -> tuple[list[int], list[bytes]]:
    """The prompt's full blocks as a prefill engine would ship them: their hashes and bytes."""
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.sampling_params import SamplingParams

    src = LLMEngine(tiny_llama.model, EngineConfig(num_kv_blocks=64, block_size=4), eos_token_ids=[2])
    src.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    hashes = src.pool.prefix_hashes(prompt)
    ids = src.pool.pin_cached(hashes)
    assert len(ids) == len(hashes)
    return hashes, [export_block(src.runner.kv_caches, b) for b in ids]


def test_an_import_never_evicts_its_own_head_and_is_evicted_from_its_end(tiny_llama):
    """The imported chain is pinned while it is written and unpinned tail first, as a finished
    sequence is freed: a pool too small for it keeps the chain's head rather than evict it for the
    tail, and a later request that needs room trims the chain from its end."""
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.kv_transfer import KVImport
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.sampling_params import SamplingParams

    prompt = [3 + i % 200 for i in range(12 * 4 + 1)]  # 12 full blocks of 4
    hashes, payloads = _exported(tiny_llama, prompt)

    def engine():
        return LLMEngine(tiny_llama.model, EngineConfig(num_kv_blocks=8, block_size=4), eos_token_ids=[2])

    short = engine()
    written = short.import_kv(prompt, KVImport(0, tuple(hashes), tuple(payloads)))
    assert written == set(hashes[:8])  # a ninth block would have had to evict the first
    assert short.pool.cached_blocks(hashes) == 8
    short.pool.check_invariants()

    roomy = engine()
    assert roomy.import_kv(prompt, KVImport(0, tuple(hashes[:6]), tuple(payloads[:6]))) == set(hashes[:6])
    other = [250 - i for i in range(4 * 4 + 1)]  # needs 5 blocks: the 2 free and 3 of the chain's
    roomy.generate([other], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert roomy.pool.cached_blocks(hashes) == 3  # head first, the chain would have kept none
    roomy.pool.check_invariants()


def test_an_import_after_a_local_prefix_keeps_the_whole_chain_ordered(tiny_llama):
    """A decode engine that holds a session's first blocks imports the next ones: the local prefix
    is not evicted to make room for them, and afterwards the combined chain leaves from its end."""
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.kv_transfer import KVImport
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.sampling_params import SamplingParams

    prompt = [3 + (7 * i) % 200 for i in range(10 * 4 + 1)]
    hashes, payloads = _exported(tiny_llama, prompt)
    dst = LLMEngine(tiny_llama.model, EngineConfig(num_kv_blocks=9, block_size=4), eos_token_ids=[2])
    dst.generate([prompt[: 3 * 4 + 1]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert dst.pool.cached_blocks(hashes) == 3
    # 7 more blocks into the 6 left: the local 3 are pinned, so the import stops at 6
    written = dst.import_kv(prompt, KVImport(3, tuple(hashes[3:]), tuple(payloads[3:])))
    assert written == set(hashes[3:9])
    assert dst.pool.cached_blocks(hashes) == 9
    other = [250 - i for i in range(4 * 4 + 1)]  # 5 blocks: all from the chain's end
    dst.generate([other], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert dst.pool.cached_blocks(hashes) == 4
    dst.pool.check_invariants()


def test_a_decode_engine_without_a_prefix_cache_pulls_nothing(tiny_llama):
    """Pulled blocks land in the prefix cache; an engine without one prefills the leg itself rather
    than pull blocks it would throw away, and says why."""
    p_engine, _, p_ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
    _, d_app, d_ctx = start_server(
        copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL, enable_prefix_caching=False
    )
    d_app.state.server.config.role = "decode"
    with p_ctx as p_url, d_ctx as d_url:
        oracle = _complete(d_url, PROMPT, 12).json()["choices"][0]["text"]
        _, decode = _pd(p_url, d_url, PROMPT, 12)
        assert decode["choices"][0]["text"] == oracle
        assert decode["kv_transfer"] == {
            "leg": "decode",
            "blocks": 0,
            "bytes": 0,
            "seconds": 0.0,
            "fallback": "no_prefix_cache",
        }
        assert decode["usage"]["prompt_token_sources"]["transferred"] == 0
        # it tells the prefill engine so, which unpins the prompt now, not at the hold's timeout
        deadline = time.monotonic() + 10
        while len(p_engine.kv_holds) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p_engine.transfer_stats.holds_cancelled == 1 and len(p_engine.kv_holds) == 0
        text = httpx.get(f"{p_url}/metrics").text
        assert "tokenops_engine_kv_transfer_holds_cancelled_total" in text


def test_a_hold_is_released_at_its_pullers_word_unless_a_pull_of_it_is_under_way(tiny_llama):
    (p_engine, p_app, p_ctx), _ = _engine_pair(tiny_llama)
    with p_ctx as p_url:
        handle = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}).json()["kv_transfer_params"]
        server = p_app.state.server
        tid, engine_id = handle["remote_request_id"], handle["remote_engine_id"]
        where = {"host": handle["remote_host"], "port": handle["remote_port"]}

        async def run() -> None:
            # a pull of it under way (begun, not ended): the hold stays
            status, _ = p_engine.kv_holds.begin(tid, handle["remote_block_ids"][:1])
            assert status == 0
            with pytest.raises(KVTransferError) as err:
                await release_hold(**where, engine_id=engine_id, transfer_id=tid)
            assert err.value.reason == "busy" and len(p_engine.kv_holds) == 1
            await server.engine.call(lambda e: e.kv_holds.end(tid, False))
            # another engine's id, then an unknown transfer: nothing released
            assert not await release_hold(**where, engine_id="another-engine", transfer_id=tid)
            assert not await release_hold(**where, engine_id=engine_id, transfer_id="no-such")
            assert len(p_engine.kv_holds) == 1
            assert await release_hold(**where, engine_id=engine_id, transfer_id=tid)
            assert not await release_hold(**where, engine_id=engine_id, transfer_id=tid)

        asyncio.run(run())
        assert len(p_engine.kv_holds) == 0 and p_engine.transfer_stats.holds_cancelled == 1
        p_engine.pool.check_invariants()
        assert p_engine.pool.num_used_blocks == 0


def test_a_decode_leg_refused_for_bad_input_releases_its_hold(tiny_llama):
    # the decode engine never pulls a leg it refuses: it tells the prefill engine, as a fallback does
    (p_engine, _, p_ctx), (_, _, d_ctx) = _engine_pair(tiny_llama, kv_hold_timeout_s=600)
    with p_ctx as p_url, d_ctx as d_url:
        handle = _complete(p_url, PROMPT, 1, {"do_remote_decode": True}).json()["kv_transfer_params"]
        assert len(p_engine.kv_holds) == 1
        refused = _complete(d_url, PROMPT, 12, handle, temperature=-1)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
        deadline = time.monotonic() + 10
        while len(p_engine.kv_holds) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(p_engine.kv_holds) == 0 and p_engine.transfer_stats.holds_cancelled == 1
        # a plain request refused the same way has no hold to release
        assert _complete(d_url, PROMPT, 12, temperature=-1).status_code == 400
        p_engine.pool.check_invariants()


def test_an_import_with_a_payload_of_the_wrong_size_registers_nothing(tiny_llama):
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.kv_transfer import KVImport
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.sampling_params import SamplingParams

    prompt = [3 + i for i in range(4 * 4 + 1)]
    hashes, payloads = _exported(tiny_llama, prompt)
    dst = LLMEngine(tiny_llama.model, EngineConfig(num_kv_blocks=8, block_size=4), eos_token_ids=[2])
    for bad in (payloads[:3] + [payloads[3][:-1]], payloads[:3]):
        with pytest.raises(ValueError):
            dst.import_kv(prompt, KVImport(0, tuple(hashes), tuple(bad)))
        assert dst.pool.cached_blocks(hashes) == 0 and dst.transfer_stats.blocks_received == 0
        # a request that brings such an import is refused whole: nothing left queued
        with pytest.raises(ValueError):
            dst.add_request(
                "r", prompt, SamplingParams(max_tokens=2), kv_import=KVImport(0, tuple(hashes), tuple(bad))
            )
        assert not dst.has_unfinished()
    dst.pool.check_invariants()
