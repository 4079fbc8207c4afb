"""A PD model whose decode pool does not answer: the client gets the cluster's clear error for a pool
that is down (502 upstream_failed once tried, 503 upstream_unavailable once the health checker has
opened its breakers; never a 500), and the request still settles into exactly one ledger row that
bills nothing."""

from __future__ import annotations

import openai
import pytest
from gateway_harness import gateway_settings, start_gateway

from tokenops.bench.ports import free_port


def test_unreachable_decode_pool_is_a_clear_error_with_one_unbilled_row(tmp_path) -> None:
    dead = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    settings = gateway_settings(
        "http://127.0.0.1:1",
        tmp_path,
        models={
            "pd-model": {
                "pd": {"prefill": dead[:1], "decode": dead[1:]},
                "pricing": {"input": 1.0, "output": 1.0},
            },
        },
    )
    gw = start_gateway(settings)
    try:
        client = gw.client(gw.new_key("pd"))
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="pd-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
        status, body = err.value.status_code, err.value.body
        assert (status, body["code"]) in {(502, "upstream_failed"), (503, "upstream_unavailable")}
        assert "pd-model" in body["message"]
        rows = gw.wait_ledger(1, model_requested="pd-model")
        assert len(rows) == 1 and rows[0]["http_status"] == status and rows[0]["cost_micros"] == 0
        assert rows[0]["uncached_input_tokens"] == rows[0]["output_tokens"] == 0
    finally:
        gw.stop()
