"""The PD dispatch over real engine servers on loopback: static PD gives the colocated answer with
the prompt's KV transferred; a dead prefill worker makes the decode worker prefill locally; a dead
decode worker is dropped and the session rebinds; every request is answered once, by one decode leg."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import httpx

from tokenops.cluster.pd import AMPD, StaticPD
from tokenops.cluster.pd_dispatch import PDDispatch, PDWorker
from tokenops.cluster.perf_model import PerfModel
from tokenops.engine.async_engine import EngineError

from .test_server import ByteTokenizer, start_server

MODEL = "tiny-pd"
PROMPT = "a tool returned forty lines of output and the agent read them all. " * 2


def _servers(tiny_llama, roles):
    out = []
    for role in roles:
        _, app, ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
        app.state.server.config.role = role
        out.append(ctx)
    return out


def _body(prompt: str, max_tokens: int = 12) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


async def _run(policy, workers, prompt, **kw):
    async with aiohttp.ClientSession() as http:
        return await PDDispatch(policy, workers, http).complete(
            "/v1/completions", _body(prompt), prompt_tokens=len(prompt), **kw
        )


def test_static_pd_through_the_dispatch_matches_colocated_and_falls_back(tiny_llama):
    p_ctx, d_ctx, solo_ctx = _servers(tiny_llama, ["prefill", "decode", "both"])
    with d_ctx as d_url, solo_ctx as solo_url:
        oracle = httpx.post(f"{solo_url}/v1/completions", json=_body(PROMPT), timeout=60).json()
        with p_ctx as p_url:
            workers = [PDWorker("p0", p_url, "prefill"), PDWorker("d0", d_url, "decode")]
            result = asyncio.run(_run(StaticPD(), workers, PROMPT))
        assert result.decision.remote
        assert result.body["choices"][0]["text"] == oracle["choices"][0]["text"]
        kinds = [leg["kind"] for leg in result.legs]
        assert kinds == ["prefill", "decode"]
        assert result.body["usage"]["prompt_token_sources"]["transferred"] > 0
        assert result.incremental_prefill_tokens == sum(leg["computed"] for leg in result.legs)
        # the prefill worker is gone now: the decode worker prefills itself, the answer is the same
        again = asyncio.run(_run(StaticPD(), workers, PROMPT + " again"))
        solo = httpx.post(f"{solo_url}/v1/completions", json=_body(PROMPT + " again"), timeout=60).json()
        assert again.body["choices"][0]["text"] == solo["choices"][0]["text"]
        assert again.decision.reason == "no-prefill-worker" and [leg["kind"] for leg in again.legs] == [
            "decode"
        ]
        assert sum(leg["kind"] == "decode" and leg["status"] == 200 for leg in again.legs) == 1
        assert again.body["usage"]["prompt_token_sources"]["transferred"] == 0


def test_dead_decode_worker_rebinds_the_session(tiny_llama):
    d0_ctx, d1_ctx = _servers(tiny_llama, ["both", "both"])
    policy = AMPD(PerfModel(base_s=0.01, per_token_s=1e-4))
    with d1_ctx as d1_url:
        with d0_ctx as d0_url:
            workers = [PDWorker("d0", d0_url, "both"), PDWorker("d1", d1_url, "both")]
            first = asyncio.run(_run(policy, workers, PROMPT, session_id="s"))
        # d0's server is closed; if the session was bound there it must move to d1 and be answered once
        second = asyncio.run(_run(policy, workers, PROMPT + " next", session_id="s", round=1))
        assert second.decision.decode == "d1"
        answered = [leg for leg in second.legs if leg["kind"] == "decode" and leg["status"] == 200]
        assert len(answered) == 1 and second.body["choices"][0]["text"]
        assert policy.bindings.get("s") == "d1"
        assert first.decision.decode in ("d0", "d1")


def test_a_decode_worker_whose_engine_is_down_is_passed_over(tiny_llama):
    # the bound decode worker's HTTP server answers but its engine is gone (503 engine_unavailable):
    # the request is placed again on the other worker and answered once there, which the session binds
    apps, ctxs = [], []
    for _ in range(2):
        _, app, ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
        apps.append(app)
        ctxs.append(ctx)
    policy = AMPD(PerfModel(base_s=0.01, per_token_s=1e-4))
    with ctxs[0] as d0_url, ctxs[1] as d1_url:
        workers = [PDWorker("d0", d0_url, "both"), PDWorker("d1", d1_url, "both")]
        first = asyncio.run(_run(policy, workers, PROMPT, session_id="s"))
        bound = first.decision.decode
        other = "d1" if bound == "d0" else "d0"

        def engine_down(*_args, **_kw):
            raise EngineError("the engine is not running")

        apps[0 if bound == "d0" else 1].state.server.engine.submit = engine_down
        second = asyncio.run(_run(policy, workers, PROMPT + " next", session_id="s", round=1))
        failed = [(leg["worker"], leg["status"]) for leg in second.passed_over if leg["kind"] == "decode"]
        answered = [(leg["worker"], leg["status"]) for leg in second.legs if leg["kind"] == "decode"]
        assert failed == [(bound, 503)] and answered == [(other, 200)]
        assert second.decision.decode == other and second.body["choices"][0]["text"]
        assert policy.bindings.get("s") == other
