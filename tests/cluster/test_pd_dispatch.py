"""A PD model through the cluster's dispatch (`Cluster.open`), over real engine servers on loopback:
the same machinery as a colocated model's requests. Static PD gives the colocated answer with the
prompt's KV transferred; a dead prefill worker makes the decode worker prefill locally and, once its
breaker opens, is no longer offered to the policy; a dead decode worker is retried before the first
byte and its session rebinds; a decode replica at its concurrency limit makes the next request wait
at the gateway; prefill legs waiting for a worker's slot are in the policies' snapshot; the prefix
index's holdings reach the policy, which decides on the uncached part;
two gateways sharing Redis count one session's rounds together and share its decode binding; the
streams relayed give each decode worker the windowed ITL the policy reads, and each stream's progress."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
import uuid

import httpx
import orjson
import pytest

from tiny_server import ByteTokenizer, start_server
from tokenops.cluster import Cluster, ClusterConfig, DispatchRequest, RequestInfo, build_cluster
from tokenops.cluster.concurrency import AIMDConfig, AIMDLimiter
from tokenops.cluster.pd import AMPD, ConditionalPD, PrefillJob, StaticPD, StreamProgress
from tokenops.cluster.pd_dispatch import PDRoute, PrefillGate
from tokenops.cluster.perf_model import PerfModel
from tokenops.cluster.prefix_index import block_hashes_from_tokens
from tokenops.config import load_settings
from tokenops.engine.async_engine import EngineError
from tokenops.protocol import APIError

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-pd"
PROMPT = "a tool returned forty lines of output and the agent read them all. " * 2
REDIS = "redis://127.0.0.1:6379/0"


def _servers(tiny_llama, roles):
    apps, ctxs = [], []
    for role in roles:
        _, app, ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
        app.state.server.config.role = role
        apps.append(app)
        ctxs.append(ctx)
    return apps, ctxs


def _body(prompt: str, max_tokens: int = 12) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _cluster(prefill: list[str], decode: list[str], policy: str = "static", **kw) -> Cluster:
    pd = {"policy": policy, "prefill": [u + "/v1" for u in prefill], "decode": [u + "/v1" for u in decode]}
    pd.update(kw.pop("pd", {}))
    settings = load_settings(None, environ={}, overrides={"models": {MODEL: {"pd": pd}}})
    return build_cluster(settings.models, ClusterConfig.model_validate(kw.pop("config", {})), **kw)


def _info(prompt: str, session: str | None = None) -> RequestInfo:
    ids = list(prompt.encode())
    return RequestInfo(
        MODEL,
        session_id=session,
        block_hashes=tuple(block_hashes_from_tokens(ids, 16)),
        block_tokens=16,
        prompt_tokens=len(ids),
        max_tokens=12,
    )


async def _ask(cluster: Cluster, prompt: str, session: str | None = None, **kw):
    """One request through the cluster: its Upstream (with `pd`) and the answer's JSON."""
    async with cluster.open(
        DispatchRequest(_info(prompt, session), "/completions", _body(prompt), **kw)
    ) as up:
        answer = orjson.loads(await up.read())
    return up, answer


async def _polled(cluster: Cluster) -> None:
    async with httpx.AsyncClient() as client:
        await cluster.poller.poll_once(client)


def _solo(url: str, prompt: str) -> str:
    return httpx.post(f"{url}/v1/completions", json=_body(prompt), timeout=60).json()["choices"][0]["text"]


def test_static_pd_through_the_cluster_matches_colocated_and_falls_back(tiny_llama):
    _, (p_ctx, d_ctx, solo_ctx) = _servers(tiny_llama, ["prefill", "decode", "both"])

    async def run(p_url, d_url, solo_url):
        cluster = _cluster(
            [p_url], [d_url], config={"breaker": {"failure_threshold": 1, "open_s": 600, "max_open_s": 600}}
        )
        await _polled(cluster)
        up, answer = await _ask(cluster, PROMPT)
        assert up.pd.decision.remote and [leg["kind"] for leg in up.pd.legs] == ["prefill"]
        assert answer["choices"][0]["text"] == _solo(solo_url, PROMPT)
        assert answer["usage"]["prompt_token_sources"]["transferred"] > 0
        assert up.pd.prefill_computed == up.pd.legs[0]["computed"] > 0
        # a rule-based policy models no leg time: the worker's pace stays unknown
        seen = cluster.pd[MODEL].snapshot(cluster.pools[MODEL].snapshot())
        assert up.pd.decision.estimate is None and seen.prefill[0].leg_pace is None
        # both legs held a slot of their pool and released it
        prefill_pool = cluster.pd[MODEL].prefill
        assert all(
            r.in_flight == 0
            for r in [*prefill_pool.replicas.values(), *cluster.pools[MODEL].replicas.values()]
        )
        p_ctx.__exit__(None, None, None)
        # the prefill worker is gone: the decode worker prefills itself, answered once
        again = PROMPT + " again"
        up, answer = await _ask(cluster, again)
        assert up.pd.decision.remote and up.pd.legs[0]["status"].startswith("failed")
        assert answer["choices"][0]["text"] == _solo(solo_url, again)
        assert answer["usage"]["prompt_token_sources"]["transferred"] == 0 and up.pd.prefill_computed == 0
        assert [a.outcome for a in up.attempts] == ["ok"]
        # its breaker is open now: the policy is not offered it and places the prefill locally
        up, answer = await _ask(cluster, again + " and again")
        assert up.pd.decision.reason == "no-prefill-worker" and up.pd.legs == []
        await cluster.aclose()

    with d_ctx as d_url, solo_ctx as solo_url:
        asyncio.run(run(p_ctx.__enter__(), d_url, solo_url))


def test_an_ampd_leg_reaches_the_snapshot_as_its_workers_pace(tiny_llama):
    # AMPD scales a prefill worker's modelled leg by its recent legs' observed over modelled time:
    # the dispatch records each AMPD leg's time against the model's figure for it
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])  # AMPD needs a profile in config: set on the route instead
        route = cluster.pd[MODEL]
        perf = PerfModel(base_s=0.01, per_token_s=1e-4)
        route.policy = AMPD(perf)
        route.ttft_slo_s = 100.0  # on time either way: the tie-break sends it remote
        await _polled(cluster)
        started = time.monotonic()
        up, _ = await _ask(cluster, PROMPT, "s")
        took = time.monotonic() - started
        est = up.pd.decision.estimate
        assert up.pd.decision.reason == "remote-slack" and est.remote_leg_s > 0
        pace = route.snapshot(cluster.pools[MODEL].snapshot()).prefill[0].leg_pace
        # the leg's own time, from asking for a slot to its answer, over the model's
        leg = up.pd.legs[0]
        assert 0 < leg["answered_s"] <= took
        own = leg["answered_s"] - leg["sent_s"] + leg["queued_s"]
        assert pace == pytest.approx(own / est.remote_leg_s)
        assert route.snapshot(cluster.pools[MODEL].snapshot()).decode[0].leg_pace is None
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_a_worker_is_credited_with_a_prompt_only_once_its_leg_answered(tiny_llama):
    # learning from the dispatch (no KV events): the prefill worker whose leg failed never held the
    # prompt and is not credited with it; the decode worker that prefilled it instead is
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])
        route, pool = cluster.pd[MODEL], cluster.pools[MODEL]
        assert pool.policy.learn
        await _polled(cluster)
        up, _ = await _ask(cluster, PROMPT)
        held = route.cached_tokens(pool, _info(PROMPT))
        assert up.pd.legs[0]["status"] == 200 and set(held) == {f"{MODEL}#0", f"{MODEL}/prefill#0"}
        p_ctx.__exit__(None, None, None)
        other = "a different prompt that no engine has computed yet, long enough for some blocks"
        up, _ = await _ask(cluster, other)
        assert up.pd.decision.prefill == f"{MODEL}/prefill#0" and up.pd.legs[0]["status"] != 200
        assert route.cached_tokens(pool, _info(other)) == {f"{MODEL}#0": len(other) // 16 * 16}
        await cluster.aclose()

    with d_ctx as d_url:
        asyncio.run(run(p_ctx.__enter__(), d_url))


def test_prefill_legs_waiting_for_a_worker_go_in_prefill_queue_order(tiny_llama, tmp_path):
    # the prefill worker takes one leg at a time and another leg holds it while a short prompt's leg
    # and then a long one's queue: with `pd.prefill_queue` the long one, the less TTFT slack, gets the
    # freed slot first; with no deferral allowed the order is arrival again
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])
    profile = tmp_path / "perf.json"
    PerfModel(base_s=0.01, per_token_s=1e-3).save(profile)
    worker = f"{MODEL}/prefill#0"
    short, long = "a short question", PROMPT

    async def sent(cluster: Cluster) -> dict[str, float]:
        """When each request's prefill leg went to the worker (monotonic clock)."""
        route = cluster.pd[MODEL]
        assert route.gate is not None
        async with route.prefill_turn(worker, PrefillJob("held", 1), None):
            first = asyncio.ensure_future(_ask(cluster, short))
            while route.gate.waiting(worker) < 1:
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(_ask(cluster, long))
            while route.gate.waiting(worker) < 2:
                await asyncio.sleep(0.01)
            hold_ended = time.monotonic()
        done = {}
        for name, task in (("short", first), ("long", second)):
            up, answer = await task
            assert answer["choices"][0]["text"] and up.pd.legs[0]["status"] == 200
            done[name] = up.pd.arrived_at + up.pd.legs[0]["sent_s"]
        assert min(done.values()) > hold_ended
        return done

    async def run(p_url, d_url):
        pd = {"prefill_queue": True, "perf_model": str(profile), "ttft_slo_s": 60}
        cluster = _cluster([p_url], [d_url], pd=pd)
        route = cluster.pd[MODEL]
        route.prefill.replicas[worker].limiter = AIMDLimiter(AIMDConfig(initial=1, min_limit=1, max_limit=1))
        await _polled(cluster)
        went = await sent(cluster)
        assert went["long"] < went["short"]
        route.gate = PrefillGate(PerfModel(base_s=0.01, per_token_s=1e-3), 60, max_deferrals=0)
        went = await sent(cluster)
        assert went["short"] < went["long"]
        # nothing is left waiting or counted as running on the worker
        assert route.gate.waiting(worker) == 0 and route.prefill.replicas[worker].in_flight == 0
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_a_prefill_leg_whose_wait_runs_out_leaves_the_decode_worker_to_prefill(tiny_llama, tmp_path):
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])
    profile = tmp_path / "perf.json"
    PerfModel(base_s=0.01, per_token_s=1e-3).save(profile)
    worker = f"{MODEL}/prefill#0"

    async def run(p_url, d_url):
        pd = {"prefill_queue": True, "perf_model": str(profile)}
        cluster = _cluster([p_url], [d_url], pd=pd)
        route = cluster.pd[MODEL]
        route.prefill.replicas[worker].limiter = AIMDLimiter(AIMDConfig(initial=1, min_limit=1, max_limit=1))
        await _polled(cluster)
        async with route.prefill_turn(worker, PrefillJob("held", 1), None):
            up, answer = await _ask(cluster, PROMPT, max_wait=0.3)
            assert up.pd.decision.remote and up.pd.legs[0]["status"] == "unavailable"
            assert answer["usage"]["prompt_token_sources"]["transferred"] == 0
            assert route.gate.waiting(worker) == 0
        # the slot held is free again: the next leg goes straight through
        up, _ = await _ask(cluster, PROMPT + " again")
        assert up.pd.legs[0]["status"] == 200
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


@pytest.mark.parametrize("gate", [True, False])
def test_the_pd_snapshot_counts_the_prefill_legs_waiting_for_a_workers_slot(tiny_llama, tmp_path, gate):
    # the prefill worker's one slot is held: a leg waits for it (at the gate, or in the prefill pool's
    # own line without one) and the policies' next snapshot shows it there with its uncached tokens;
    # a second leg sharing its prefix adds only the blocks the first does not compute
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])
    profile = tmp_path / "perf.json"
    PerfModel(base_s=0.01, per_token_s=1e-3).save(profile)
    worker = f"{MODEL}/prefill#0"

    async def run(p_url, d_url):
        pd = {"prefill_queue": True, "perf_model": str(profile)} if gate else {}
        cluster = _cluster([p_url], [d_url], pd=pd)
        route, pool = cluster.pd[MODEL], cluster.pools[MODEL]
        prefill = route.prefill.replicas[worker]
        prefill.limiter = AIMDLimiter(AIMDConfig(initial=1, min_limit=1, max_limit=1))
        await _polled(cluster)

        def waiting() -> tuple[int, int]:
            (load,) = route.snapshot(pool.snapshot()).prefill
            return load.waiting_legs, load.waiting_prefill_tokens

        assert waiting() == (0, 0)
        async with route.prefill_slot(worker, PrefillJob("held", 1), _info("held"), None):
            task = asyncio.ensure_future(_ask(cluster, PROMPT))
            deadline = time.monotonic() + 30
            while waiting() == (0, 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            # nothing of the prompt is cached on the prefill worker yet: all of it is work ahead
            assert waiting() == (1, len(PROMPT.encode()))
            assert route.snapshot(pool.snapshot()).prefill[0].prefill_backlog_tokens >= len(PROMPT.encode())
            # a second leg sharing the prompt's full blocks adds only its own: the first computes them
            second = PROMPT + "then it wrote the fix."
            other = asyncio.ensure_future(_ask(cluster, second))
            while waiting()[0] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            shared = len(PROMPT.encode()) // 16 * 16
            assert waiting() == (2, len(PROMPT.encode()) + len(second.encode()) - shared)
        for up, answer in await asyncio.gather(task, other):
            assert up.pd.legs[0]["status"] == 200 and answer["choices"][0]["text"]
        assert waiting() == (0, 0) and prefill.in_flight == 0
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


async def _session_bound_to_one_of_two(d0_url: str, d1_url: str, **kw) -> tuple[Cluster, str, str]:
    """A cluster of two decode workers under AMPD after session "s"'s first request: the cluster,
    the worker the session is bound to and the other one."""
    cluster = _cluster([], [d0_url, d1_url], policy="colocated", **kw)
    cluster.pd[MODEL].policy = AMPD(PerfModel(base_s=0.01, per_token_s=1e-4))
    await _polled(cluster)
    first, _ = await _ask(cluster, PROMPT, "s")
    bound = first.pd.decision.decode
    return cluster, bound, f"{MODEL}#1" if bound == f"{MODEL}#0" else f"{MODEL}#0"


def test_dead_decode_worker_is_retried_and_the_session_rebinds(tiny_llama):
    _, (d0_ctx, d1_ctx) = _servers(tiny_llama, ["both", "both"])

    async def run(d0_url, d1_url):
        cluster, bound, other = await _session_bound_to_one_of_two(d0_url, d1_url)
        route = cluster.pd[MODEL]
        (d0_ctx if bound == f"{MODEL}#0" else d1_ctx).__exit__(None, None, None)
        second, answer = await _ask(cluster, PROMPT + " next", "s")
        # the failed try is retried on the other worker before the first byte: answered once there
        assert [(a.replica, a.outcome == "ok") for a in second.attempts] == [(bound, False), (other, True)]
        assert second.pd.decision.decode == other and answer["choices"][0]["text"]
        assert route.policy.bindings.get("s") == other and second.pd.round == 1
        await cluster.aclose()

    with d0_ctx as d0_url, d1_ctx as d1_url:
        asyncio.run(run(d0_url, d1_url))


def test_a_decode_worker_whose_engine_is_down_is_passed_over(tiny_llama):
    # the bound decode worker's HTTP server answers but its engine is gone (503 engine_unavailable):
    # the request is tried again on the other worker and answered once there, which the session binds
    apps, (c0, c1) = _servers(tiny_llama, ["both", "both"])

    async def run(d0_url, d1_url):
        cluster, bound, other = await _session_bound_to_one_of_two(d0_url, d1_url)
        route = cluster.pd[MODEL]

        def engine_down(*_args, **_kw):
            raise EngineError("the engine is not running")

        apps[0 if bound == f"{MODEL}#0" else 1].state.server.engine.submit = engine_down
        second, answer = await _ask(cluster, PROMPT + " next", "s")
        assert [(a.replica, a.outcome) for a in second.attempts] == [(bound, "status 503"), (other, "ok")]
        assert second.pd.decision.decode == other and answer["choices"][0]["text"]
        assert route.policy.bindings.get("s") == other
        await cluster.aclose()

    with c0 as d0_url, c1 as d1_url:
        asyncio.run(run(d0_url, d1_url))


def test_a_decode_replica_at_its_limit_makes_the_next_request_wait(tiny_llama):
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])
    one = {"concurrency": {"initial": 1, "min": 1}}

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url], config=one)
        await _polled(cluster)
        call = DispatchRequest(_info(PROMPT), "/completions", _body(PROMPT))
        async with cluster.open(call) as held:
            # the only decode slot is held: the next request waits at the gateway, then is refused
            with pytest.raises(APIError) as err:
                await _ask(cluster, PROMPT + " second", max_wait=0.3)
            assert err.value.status == 429 and err.value.code == "backend_busy"
            # nothing of it reached an engine: neither leg was sent
            assert cluster.pd[MODEL].prefill.replicas[f"{MODEL}/prefill#0"].in_flight == 0
            waiter = asyncio.ensure_future(_ask(cluster, PROMPT + " third", max_wait=30))
            await asyncio.sleep(0.3)
            assert not waiter.done() and cluster.pools[MODEL].waiting == 1
            await held.read()
        up, answer = await waiter  # the slot freed: the waiting request went through
        assert answer["choices"][0]["text"] and up.pd.decision.remote
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_the_policy_decides_on_the_part_the_decode_worker_lacks(tiny_llama):
    # Dynamo's rule with a threshold between the next round's new tokens and its whole prompt: the
    # prefix index says the bound decode worker holds the history, so the round stays local
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])
        route = cluster.pd[MODEL]
        route.policy = ConditionalPD.dynamo(max_local_prefill_length=64)
        await _polled(cluster)
        first, _ = await _ask(cluster, PROMPT, "s")
        assert first.pd.decision.remote and first.pd.job.cached_tokens == {}
        follow = PROMPT + " then it called another tool."
        second, answer = await _ask(cluster, follow, "s")
        decode = second.pd.decision.decode
        held = second.pd.job.cached_on(decode)
        assert held >= len(PROMPT) - 16 and second.pd.job.prompt_tokens > 64
        assert second.pd.decision.prefill is None and second.pd.decision.reason == "short-uncached"
        assert answer["usage"]["prompt_token_sources"]["local_cache"] > 0
        picks = cluster.pools[MODEL].picks
        assert picks[(decode, "pd long-uncached")] == picks[(decode, "pd short-uncached")] == 1
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_two_gateways_count_a_sessions_rounds_together_in_redis(tiny_llama):
    # each gateway sends one round of the same session, the first prefilled on the decode engine, the
    # second on the prefill engine: it is round 1, so its prefill leg names the decode engine as the
    # history's source and the prefill engine pulls the history from there instead of recomputing it
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])
    prefix = f"test-pd-{uuid.uuid4().hex}:"

    async def run(p_url, d_url):
        gateways = [_cluster([p_url], [d_url], redis_url=REDIS, redis_prefix=prefix) for _ in range(2)]
        gateways[0].pd[MODEL].policy = ConditionalPD.dynamo(max_local_prefill_length=10_000)
        gateways[1].pd[MODEL].policy = StaticPD(incremental=True)
        for g in gateways:
            await _polled(g)
        first, _ = await _ask(gateways[0], PROMPT, "shared")
        follow = PROMPT + " then it called another tool."
        second, _ = await _ask(gateways[1], follow, "shared")
        assert (first.pd.round, second.pd.round) == (0, 1) and not first.pd.decision.remote
        leg = second.pd.legs[0]
        assert leg["kind"] == "prefill" and leg["transferred"] >= len(PROMPT) - 8
        # a gateway that counted alone would have called it round 0 and recomputed the history
        alone = _cluster([p_url], [d_url])
        assert (await alone.pd[MODEL].rounds.next("shared")).round == 0
        for g in [*gateways, alone]:
            await g.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_static_pd_as_vllm_ships_it_recomputes_the_history_the_incremental_one_pulls(tiny_llama):
    # each session's first round is prefilled on the decode engine; its second goes to the prefill
    # engine, which lacks the history: vLLM's path recomputes it there, ours pulls it from the decode one;
    # the policies' snapshot counts each leg under way by what it will compute
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])
        route = cluster.pd[MODEL]
        await _polled(cluster)
        counted: list[tuple[str, int]] = []
        prefilling = route.prefilling

        def counting(worker: str, tokens: int):
            counted.append((worker, tokens))
            return prefilling(worker, tokens)

        route.prefilling = counting
        legs = {}
        for session, policy in (("vllm", StaticPD()), ("ours", StaticPD(incremental=True))):
            prompt = f"{session}: {PROMPT}"
            route.policy = ConditionalPD.dynamo(max_local_prefill_length=10_000)
            first, _ = await _ask(cluster, prompt, session)
            assert not first.pd.decision.remote
            route.policy = policy
            second, _ = await _ask(cluster, prompt + " then it called another tool.", session)
            assert second.pd.round == 1 and second.pd.decision.pull_history == policy.incremental
            legs[session] = second.pd.legs[0]
            assert counted[-1][0] == second.pd.decision.prefill
            legs[session]["counted"] = counted[-1][1]
        assert legs["vllm"]["transferred"] == 0 and legs["vllm"]["computed"] >= len(PROMPT)
        assert legs["ours"]["transferred"] >= len(PROMPT) - 8 and legs["ours"]["computed"] < 48
        # vLLM's leg counts the whole prompt its worker lacks, ours only what neither worker holds
        # (by the prefix index: the history's full blocks)
        assert legs["ours"]["counted"] < 48 < len(PROMPT) <= legs["vllm"]["counted"]
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_two_gateways_share_a_sessions_decode_binding_in_redis(tiny_llama):
    # gateway A binds the session; gateway B, whose own policy holds a stale binding to the other
    # worker, sends the next round where A bound it; when that worker dies, B's retry rebinds the
    # session and A's next round follows without trying the dead worker first
    _, (d0_ctx, d1_ctx) = _servers(tiny_llama, ["both", "both"])
    prefix = f"test-pd-{uuid.uuid4().hex}:"
    shared = {"redis_url": REDIS, "redis_prefix": prefix}

    async def run(d0_url, d1_url):
        a, bound, other = await _session_bound_to_one_of_two(d0_url, d1_url, **shared)
        b = _cluster([], [d0_url, d1_url], policy="colocated", **shared)
        b.pd[MODEL].policy = AMPD(PerfModel(base_s=0.01, per_token_s=1e-4))
        b.pd[MODEL].policy.bindings.bind("s", other)
        await _polled(b)
        second, _ = await _ask(b, PROMPT + " next", "s")
        assert second.pd.round == 1 and [x.replica for x in second.attempts] == [bound]
        (d0_ctx if bound == f"{MODEL}#0" else d1_ctx).__exit__(None, None, None)
        third, _ = await _ask(b, PROMPT + " next again", "s")
        assert [(x.replica, x.outcome == "ok") for x in third.attempts] == [(bound, False), (other, True)]
        fourth, answer = await _ask(a, PROMPT + " and the last", "s")
        assert [(x.replica, x.outcome) for x in fourth.attempts] == [(other, "ok")]
        assert fourth.pd.round == 3 and answer["choices"][0]["text"]
        # without Redis a gateway binds alone: its own policy's choice stands
        alone = _cluster([], [d0_url, d1_url], policy="colocated")
        assert (await alone.pd[MODEL].rounds.next("s")).bound is None
        for g in (a, b, alone):
            await g.aclose()

    with d0_ctx as d0_url, d1_ctx as d1_url:
        asyncio.run(run(d0_url, d1_url))


def test_the_decode_workers_windowed_itl_comes_from_the_streams_relayed(tiny_llama):
    # a streamed answer relayed through the cluster feeds its decode worker's ITL window, which the
    # next snapshot hands the policy; the figure is the mean of the gaps the client saw
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])
        await _polled(cluster)
        route = cluster.pd[MODEL]
        assert route.snapshot(cluster.pools[MODEL].snapshot()).decode[0].itl_recent_s is None
        body = {**_body(PROMPT, max_tokens=24), "stream": True, "ignore_eos": True}
        stamps = []
        async with cluster.open(DispatchRequest(_info(PROMPT), "/completions", body)) as up:
            async for chunk in up.aiter_bytes():
                stamps += [asyncio.get_running_loop().time()] * chunk.count(b"data: {")
        seen = route.snapshot(cluster.pools[MODEL].snapshot()).decode[0].itl_recent_s
        client = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        assert len(stamps) >= 24 and seen is not None
        assert seen == pytest.approx(client, rel=0.25)
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_the_decode_workers_streams_under_way_reach_the_snapshot_as_far_as_each_has_come(tiny_llama):
    # AMPD weighs a local prefill against each running stream's mean gap to come: the snapshot
    # carries every stream the gateway relays from the worker, its gaps so far and tokens to come,
    # from its placement until the call is done
    _, (p_ctx, d_ctx) = _servers(tiny_llama, ["prefill", "decode"])

    async def run(p_url, d_url):
        cluster = _cluster([p_url], [d_url])
        await _polled(cluster)
        route, pool = cluster.pd[MODEL], cluster.pools[MODEL]
        info = dataclasses.replace(_info(PROMPT), max_tokens=24)
        body = {**_body(PROMPT, max_tokens=24), "stream": True, "ignore_eos": True}
        seen = []
        async with cluster.open(DispatchRequest(info, "/completions", body)) as up:
            tokens = 0
            async for chunk in up.aiter_bytes():
                tokens += chunk.count(b"data: {")
                (stream,) = route.snapshot(pool.snapshot()).decode[0].streams
                seen.append((tokens, stream))
        assert route.snapshot(pool.snapshot()).decode[0].streams == ()
        for tokens, stream in seen[:-1]:  # the last events carry the usage and [DONE]
            assert (stream.gaps, stream.remaining) == (tokens - 1, 24 - tokens)
        assert seen[-2][1].elapsed_s > 0
        await cluster.aclose()

    with p_ctx as p_url, d_ctx as d_url:
        asyncio.run(run(p_url, d_url))


def test_a_stream_of_unknown_length_is_left_out_and_a_closed_one_leaves():
    route = PDRoute(StaticPD(), None)
    known, unknown = route.stream_gaps("d0", max_tokens=5), route.stream_gaps("d0")
    known.relayed(
        b'data: {"x": 1}\n\ndata: {"x": 2}\n\n'
    )  # two tokens in the first chunk: one gap of no time
    assert route.streams("d0") == (StreamProgress(1, 0.0, 3),)
    assert unknown.progress() is None and route.streams("d1") == ()
    known.close()
    known.close()  # twice is harmless
    assert route.streams("d0") == ()
