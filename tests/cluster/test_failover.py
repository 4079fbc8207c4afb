"""Kill a replica process under load: requests that had not started succeed elsewhere, the breaker
opens, the supervisor restarts the process and the replica returns through half-open and slow start.
Also the supervisor on its own: restart of a killed process, giving up on a crash loop, clean stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from tokenops.bench.ports import free_port
from tokenops.cluster.dispatch import Cluster, DispatchRequest, RetryConfig, UpstreamBroken
from tokenops.cluster.health import BreakerState, ReplicaBreakerSettings
from tokenops.cluster.policies import LeastOutstanding
from tokenops.cluster.pool import ReplicaPool, ReplicaSpec
from tokenops.cluster.snapshot import RequestInfo
from tokenops.cluster.supervisor import ProcessSpec, Supervisor
from tokenops.protocol import APIError

from .conftest import replica_process

CHAT = "/v1/chat/completions"
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}


async def wait_until(cond, timeout: float = 30.0, step: float = 0.05) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


async def test_kill_a_replica_under_load() -> None:
    specs = [replica_process(f"r{i}", free_port()) for i in range(3)]
    cluster: Cluster | None = None
    sup = Supervisor(
        specs, restart_delay=1.0, on_restart=lambda name: cluster and cluster.replica_restarted(url[name])
    )
    url = {s.name: s.url for s in specs}
    await sup.start()
    try:
        await sup.wait_ready(timeout=60)
        breaker = ReplicaBreakerSettings(
            failure_threshold=2,
            open_seconds=0.5,
            max_open_seconds=1.0,
            probe_successes=2,
            slow_start_seconds=8.0,
        )
        replicas = [ReplicaSpec(url=s.url, id=s.name, kind="tokenops") for s in specs]
        pool = ReplicaPool("m", replicas, LeastOutstanding(), breaker=breaker)
        cluster = Cluster(
            {"m": pool},
            retry=RetryConfig(attempts=3, backoff_base=0.01, first_byte_timeout=10),
            health_check_interval=0.2,
            load_poll_interval=0.2,
        )
        await cluster.start()
        await wait_until(lambda: all(r.reported is not None for r in pool.replicas.values()))

        outcomes: list[tuple[str, str, int]] = []  # (replica, outcome, chunks received)
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            got = 0
            replica = "?"
            try:
                body = dict(BODY, chunk_delay=0.05)
                async with cluster.open(DispatchRequest(RequestInfo(model="m"), CHAT, body)) as up:
                    replica = up.replica
                    async for chunk in up.aiter_bytes():
                        got += chunk.count(b"data: {")
                outcomes.append((replica, "ok", got))
            except UpstreamBroken:
                outcomes.append((replica, "broken", got))
            except APIError as err:
                outcomes.append((replica, f"error {err.status}", got))
            done += 1

        async def load(n: int, concurrency: int) -> None:
            sem = asyncio.Semaphore(concurrency)

            async def gated(i: int) -> None:
                async with sem:
                    await one(i)

            await asyncio.gather(*(gated(i) for i in range(n)))

        victim = sup.pid("r0")
        assert victim is not None
        traffic = asyncio.create_task(load(40, 6))
        await wait_until(lambda: done >= 6 and pool.replicas["r0"].in_flight > 0)
        os.kill(victim, signal.SIGKILL)
        await traffic

        # requests that had not started streaming succeeded elsewhere; only streams already
        # running on the killed replica broke, and none was re-run
        assert not [o for o in outcomes if o[1].startswith("error")], outcomes
        broken = [o for o in outcomes if o[1] == "broken"]
        assert all(r == "r0" for r, _, _ in broken), broken
        assert all(got >= 1 for _, _, got in broken)  # they had their first byte before the kill
        assert sum(1 for o in outcomes if o[1] == "ok") >= 40 - 6
        r0 = pool.replicas["r0"]
        assert BreakerState.OPEN in [s for s, _ in r0.breaker.transitions]

        # the supervisor restarts it; active health checks take it through half-open back to closed
        await wait_until(lambda: sup.restarts["r0"] == 1 and sup.pid("r0") not in (None, victim))
        await wait_until(lambda: r0.breaker.state is BreakerState.CLOSED, timeout=60)
        states = [s for s, _ in r0.breaker.transitions]
        assert states[-2:] == [BreakerState.HALF_OPEN, BreakerState.CLOSED]
        # slow start: it returns with a fraction of its weight and concurrency
        assert r0.breaker.weight_factor() < 1.0
        assert r0.effective_limit() < r0.limiter.limit
        # and it takes traffic again
        outcomes.clear()
        await load(12, 1)
        assert {o[1] for o in outcomes} == {"ok"}
        assert any(r == "r0" for r, _, _ in outcomes), outcomes
    finally:
        if cluster is not None:
            await cluster.aclose()
        await sup.stop()


async def test_supervisor_restarts_a_killed_process_and_stops_cleanly() -> None:
    restarted: list[str] = []
    spec = ProcessSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(120)"))
    sup = Supervisor([spec], restart_delay=0.05, on_restart=restarted.append)
    await sup.start()
    try:
        first = sup.pid("sleeper")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: sup.restarts["sleeper"] == 1 and sup.pid("sleeper") not in (None, first))
        assert restarted == ["sleeper"]
    finally:
        await sup.stop(timeout=5)
    assert sup.pid("sleeper") is None
    await asyncio.sleep(0.2)
    assert sup.restarts["sleeper"] == 1  # a stop is not a crash: no restart


async def test_supervisor_gives_up_on_a_crash_loop() -> None:
    spec = ProcessSpec("crasher", (sys.executable, "-c", "raise SystemExit(3)"))
    sup = Supervisor([spec], restart_delay=0.01, max_restart_delay=0.05, max_restarts_per_minute=3)
    await sup.start()
    try:
        await wait_until(lambda: "crasher" in sup.gave_up, timeout=30)
        assert sup.restarts["crasher"] == 3
    finally:
        await sup.stop()


def test_replica_app_answers_with_its_name() -> None:
    # guards the fixture itself: the SSE chunks carry the replica's name, used by the tests above
    from starlette.testclient import TestClient

    from .replica_app import build_app

    with TestClient(build_app("rx")) as client:
        resp = client.post("/v1/chat/completions", json=BODY)
        chunks = [json.loads(x[6:]) for x in resp.text.split("\n") if x.startswith("data: {")]
        assert len(chunks) == 5 and chunks[0]["replica"] == "rx"
