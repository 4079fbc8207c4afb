"""The diagnostic probes (`tokenops serve --probes`, gateway/probes.py) through a real gateway in front
of the bench stub, both in this process so that every stamp is on the test's own perf_counter clock:
the `x-tokenops-timing` stamps come in path order inside the client's request, the upstream steps
are observed once per request, the loop probe sees a blocked event loop, and without `--probes`
none of it exists. No speed is asserted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import MODEL, RunningGateway, gateway_settings, start_gateway
from prometheus_client.parser import text_string_to_metric_families

from tokenops.gateway.probes import TIMING_FIELDS, LoopProbe

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "probe me"}],
    "max_tokens": 4,
    "stream": True,
}


@pytest.fixture(scope="module")
def probed(stub: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    gw = start_gateway(gateway_settings(stub[0], tmp_path_factory.mktemp("gw-probes")), probes=True)
    yield gw
    gw.stop()


def series(gw: RunningGateway) -> dict[str, float]:
    """Every sample on /metrics by name and sorted labels, for the stub's model or unlabelled."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text):
        for s in family.samples:
            if s.labels.get("model", MODEL) == MODEL:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def stream(gw: RunningGateway, key: str) -> tuple[httpx.Response, float, float]:
    t0 = time.perf_counter_ns()
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}
    ) as resp:
        body = resp.read()
    t1 = time.perf_counter_ns()
    assert resp.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
    return resp, t0, t1


def test_the_timing_header_holds_the_path_in_order_on_the_clients_clock(probed: RunningGateway) -> None:
    key = probed.new_key("probe-order")
    for _ in range(3):
        resp, t0, t1 = stream(probed, key)
        gw_part, _, stub_part = resp.headers["x-tokenops-timing"].partition(";")
        gw = {k: int(v) for k, v in (p.split("=") for p in gw_part.split(","))}
        stub = {k: int(v) for k, v in (p.split("=") for p in stub_part.split(","))}
        assert tuple(gw) == TIMING_FIELDS
        marks = [
            t0,
            gw["received"],
            gw["upstream_sent"],
            gw["conn_ready"],
            gw["body_sent"],
            stub["received"],
            stub["ready"],
            gw["resp_headers"],
            gw["upstream_in"],
            t1,
        ]
        assert all(m > 0 for m in marks) and marks == sorted(marks), marks


def test_upstream_steps_and_connections_are_observed_once_per_request(probed: RunningGateway) -> None:
    key = probed.new_key("probe-steps")
    stream(probed, key)  # the connection to the stub is pooled from here on
    time.sleep(0.2)
    before = series(probed)
    for _ in range(3):
        stream(probed, key)
    deadline = time.monotonic() + 10
    while True:  # observed after the last byte, with the settle
        after = series(probed)
        grown = (
            after["tokenops_gateway_settle_seconds_count{}"]
            - before["tokenops_gateway_settle_seconds_count{}"]
        )
        if grown >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for step in ("connect", "write", "headers", "first_chunk"):
        name = f"tokenops_gateway_upstream_{step}_seconds"
        assert after[name + "_count{}"] - before[name + "_count{}"] == 3, step
        assert after[name + "_sum{}"] >= before[name + "_sum{}"]
    conns = "tokenops_gateway_upstream_connections_total{new=false}"
    assert after[conns] - before.get(conns, 0) == 3
    # the loop probe runs all along: ~1,000 observations a second
    assert (
        after["tokenops_gateway_loop_lag_seconds_count{}"]
        > before["tokenops_gateway_loop_lag_seconds_count{}"]
    )
    assert (
        after["tokenops_gateway_loop_pass_seconds_count{}"]
        > before["tokenops_gateway_loop_pass_seconds_count{}"]
    )


def test_without_probes_nothing_is_stamped_or_exported(gateway: RunningGateway) -> None:
    resp, _, _ = stream(gateway, gateway.new_key("no-probes"))
    assert "x-tokenops-timing" not in resp.headers
    names = series(gateway)
    assert not [n for n in names if "_loop_" in n or "gateway_upstream_" in n]


class Observed(list):
    def observe(self, seconds: float) -> None:
        self.append(seconds)


def test_the_loop_probe_sees_a_blocked_loop() -> None:
    lag, one_pass = Observed(), Observed()

    async def main() -> None:
        probe = LoopProbe(lag, one_pass, interval=0.001)
        probe.start()
        await asyncio.sleep(0.05)
        n = len(lag)
        time.sleep(0.03)  # block the event loop: the sleeping probe wakes at least 30 ms late
        await asyncio.sleep(0.01)
        await probe.stop()
        assert max(lag[n:]) >= 0.025, lag[n:]

    asyncio.run(main())
    assert len(one_pass) >= 5 and min(lag) >= 0 and min(one_pass) >= 0


def test_the_timing_header_passes_on_only_a_backends_stamps() -> None:
    """Any backend may send `x-stub-timing`: stamps are appended, anything else (text a header can
    carry but latin-1 cannot encode, garbage) is dropped rather than failing the response."""
    from tokenops.gateway.probes import timing_header
    from tokenops.gateway.timing import PathTimer

    timer = PathTimer(123)
    _, plain = timing_header(timer)
    assert plain.startswith(b"received=123,")
    assert timing_header(timer, "received=5,ready=9")[1] == plain + b";received=5,ready=9"
    for junk in ("€uro", "received=5;evil", "received=\udcff"):
        assert timing_header(timer, junk)[1] == plain
