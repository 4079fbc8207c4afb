"""Fair admission through HTTP: a real gateway on loopback in front of a slow stub, two admitted
requests in flight at most. A flooding tenant is queued up to its flow's cap and refused beyond it,
while a quiet tenant's requests are served in the next rounds instead of behind the flood; a higher
class goes before a lower one; the gate's pure scheduler hands every freed slot on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway

from tokenops.bench.stub import StubConfig, run_stub_in_thread
from tokenops.config import FairQueueConfig, PriorityClass
from tokenops.gateway.admission_gate import AdmissionGate
from tokenops.protocol import APIError

FLOOD_CAP = 12


@pytest.fixture(scope="module")
def fair_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    stub = StubConfig(models=[MODEL], output_tokens=4, ttft_s=0.15)
    url, stop_stub = run_stub_in_thread(stub)
    settings = gateway_settings(
        url,
        tmp_path_factory.mktemp("fair"),
        queue={"classes": [{"max_wait_s": 30, "max_queued": 100}] * 3},
        fair_queue={"max_in_flight": 2, "max_queued_per_tenant": FLOOD_CAP, "aging_s": None},
    )
    gw = start_gateway(settings)
    gw.stub = stub  # a test may slow the provider down
    yield gw
    gw.stop()
    stop_stub()


async def _ask(gw: RunningGateway, key: str, tag: str, done: list[str]) -> str:
    async with gw.async_client(key, timeout=60) as client:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": tag}], max_tokens=4
            )
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after")
            return e.code or "429"
        done.append(tag)
        return "ok"


def test_a_quiet_tenant_is_served_between_the_flood(fair_gateway: RunningGateway) -> None:
    gw = fair_gateway
    noisy = gw.new_key("noisy", org="noisy-org")
    quiet = gw.new_key("quiet", org="quiet-org")
    done: list[str] = []

    async def scenario() -> tuple[list[str], list[str]]:
        flood = [asyncio.ensure_future(_ask(gw, noisy, f"noisy-{i}", done)) for i in range(30)]
        await asyncio.sleep(0.3)  # the flood holds both slots and its whole flow
        calm = [asyncio.ensure_future(_ask(gw, quiet, f"quiet-{i}", done)) for i in range(4)]
        return list(await asyncio.gather(*flood)), list(await asyncio.gather(*calm))

    flood, calm = asyncio.run(scenario())
    assert calm == ["ok"] * 4
    # the flood: two in flight, FLOOD_CAP waiting, the rest refused at once with the flow's code
    assert flood.count("ok") == 2 + FLOOD_CAP
    assert set(flood) - {"ok"} == {"tenant_queue_full"}
    # round robin: each quiet request goes within a round of two of arriving, not after the 12 queued
    quiet_at = [i for i, tag in enumerate(done) if tag.startswith("quiet")]
    assert quiet_at[-1] < 2 + 2 * 4 + 1, done
    assert [t for t in done if t.startswith("noisy")][-1] == done[-1]
    # every answer and refusal of the flood has its ledger row; the refused cost nothing
    noisy_id = next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["name"] == "noisy")
    rows = gw.wait_ledger(2 + FLOOD_CAP, key_id=noisy_id)
    assert len([r for r in rows if r["status"] == "ok"]) == 2 + FLOOD_CAP
    line = gw.admin("GET", "/admin/admission").json()["lines"][MODEL]
    assert line["capacity"] == 2 and line["in_flight"] == 0 and line["waiting"] == {}
    assert line["served_after_wait"] == {"noisy-org": FLOOD_CAP, "quiet-org": 4}


def test_a_higher_class_is_admitted_first(fair_gateway: RunningGateway) -> None:
    gw = fair_gateway
    high = gw.new_key("prio-high", {"priority": 0}, org="prio-high-org")
    low = gw.new_key("prio-low", {"priority": 2}, org="prio-low-org")
    done: list[str] = []

    async def line_shows(check) -> None:  # noqa: ANN001 - the gate's state, read through the admin API
        for _ in range(400):
            state = (await asyncio.to_thread(gw.admin, "GET", "/admin/admission")).json()["lines"][MODEL]
            if check(state):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the admission line never reached the state: {state}")

    async def scenario() -> None:
        holders = [asyncio.ensure_future(_ask(gw, low, f"hold-{i}", done)) for i in range(2)]
        await line_shows(lambda s: s["in_flight"] == 2)
        lows = [asyncio.ensure_future(_ask(gw, low, f"low-{i}", done)) for i in range(3)]
        await line_shows(lambda s: s["waiting"].get("prio-low-org") == 3)  # the low class queued first
        highs = [asyncio.ensure_future(_ask(gw, high, f"high-{i}", done)) for i in range(3)]
        await line_shows(lambda s: s["waiting"].get("prio-high-org") == 3)
        assert set(await asyncio.gather(*holders, *lows, *highs)) == {"ok"}

    gw.stub.ttft_s = 1.0  # the holders keep both slots while both classes queue behind them
    try:
        asyncio.run(scenario())
    finally:
        gw.stub.ttft_s = 0.15
    order = [t.split("-")[0] for t in done if not t.startswith("hold")]
    assert order == ["high"] * 3 + ["low"] * 3, done


def test_a_low_class_ages_past_a_steady_high_stream() -> None:
    """A class-2 waiter behind a line kept full by class-0 arrivals: aging lifts it into band 0 after
    two `aging_s`, where it is a new flow and gets the next turn; with aging off it would wait on."""
    now = [0.0]
    gate = AdmissionGate(
        FairQueueConfig(max_in_flight=1, aging_s=1.0),
        [PriorityClass(max_wait_s=1e9, max_queued=100)] * 3,
        clock=lambda: now[0],
    )

    async def scenario() -> int:
        first = await gate.enter(MODEL, "chat", 0)
        low = asyncio.ensure_future(gate.enter(MODEL, "batch", 2))
        await asyncio.sleep(0)
        held = first
        for tick in range(1, 10):
            nxt = asyncio.ensure_future(gate.enter(MODEL, "chat", 0))  # always one class-0 waiter
            await asyncio.sleep(0)
            now[0] = tick * 0.75
            held.release()  # the freed slot goes to exactly one of the two
            await asyncio.wait({low, nxt}, return_when=asyncio.FIRST_COMPLETED)
            if low.done():
                nxt.cancel()
                return tick
            held = nxt.result()
        raise AssertionError("the low class was starved")

    assert asyncio.run(scenario()) == 3  # waited 2.25 s: two bands up at the third freed slot


def test_a_waiter_past_its_class_wait_is_refused_and_the_line_moves_on() -> None:
    gate = AdmissionGate(FairQueueConfig(max_in_flight=1), [PriorityClass(max_wait_s=0.05, max_queued=9)])

    async def scenario() -> None:
        slot = await gate.enter(MODEL, "t", 0)
        with pytest.raises(APIError) as err:
            await gate.enter(MODEL, "t", 0)
        assert err.value.status == 429 and err.value.code == "backend_busy"
        assert gate.state()[MODEL]["waiting"] == {}
        slot.release()
        slot.release()  # idempotent: one slot given back once
        again = await gate.enter(MODEL, "u", 0)
        assert gate.state()[MODEL]["in_flight"] == 1
        again.release()

    asyncio.run(scenario())


def test_a_line_that_follows_the_pool_takes_what_the_pool_takes_now() -> None:
    cap = [1]
    gate = AdmissionGate(
        FairQueueConfig(follow_pool=True, max_in_flight=3),
        [PriorityClass(max_wait_s=5, max_queued=9)],
        pool_capacity=lambda model: cap[0] if model == MODEL else None,
    )

    async def scenario() -> None:
        other = await gate.enter("a-route", "t", 0)  # no pool and no fixed cap of its own: the fixed 3
        assert other.line is not None and gate.capacity("a-route") == 3
        first = await gate.enter(MODEL, "t", 0)
        waiting = [asyncio.ensure_future(gate.enter(MODEL, "t", 0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert gate.state()[MODEL]["waiting"] == {"t": 3}
        cap[0] = 5  # the replicas' limits grew: the next hand-over fills up to the fixed cap of 3
        first.release()
        slots = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert gate.state()[MODEL]["in_flight"] == 3 and gate.capacity(MODEL) == 3
        for s in [*slots, other]:
            s.release()

    asyncio.run(scenario())


def test_a_pool_that_grows_lets_the_waiters_in_without_a_release() -> None:
    cap = [1]
    gate = AdmissionGate(
        FairQueueConfig(follow_pool=True),
        [PriorityClass(max_wait_s=5, max_queued=9)],
        pool_capacity=lambda model: cap[0],
    )

    async def scenario() -> None:
        first = await gate.enter(MODEL, "t", 0)
        waiter = asyncio.ensure_future(gate.enter(MODEL, "t", 0))
        await asyncio.sleep(0.01)
        cap[0] = 3  # the replicas' limits grew while nobody left
        arrival = await asyncio.wait_for(gate.enter(MODEL, "u", 0), 1)
        second = await asyncio.wait_for(waiter, 1)  # the earlier waiter went in with it
        assert gate.state()[MODEL]["in_flight"] == 3
        for s in (first, second, arrival):
            s.release()

    asyncio.run(scenario())
