"""Schemathesis fuzzing of the gateway's OpenAPI document for the public endpoints: whatever the body,
the gateway answers with a 2xx or a 4xx OpenAI error, never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
import yaml
from gateway_harness import RunningGateway
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tokenops.gateway.app import OPENAPI_FILE

SCHEMA = schemathesis.openapi.from_dict(yaml.safe_load(OPENAPI_FILE.read_text()))
OPERATIONS = [
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model}", "GET"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/embeddings", "POST"),
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_no_server_errors(gateway: RunningGateway, path: str, method: str, mode: GenerationMode) -> None:
    name = f"fuzz-{mode.value}-{method}-{path}".replace("/", "_").replace("{", "").replace("}", "")
    key = gateway.new_key(name)
    strategy = SCHEMA[path][method].as_strategy(generation_mode=mode)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def check(case) -> None:
        for cap in ("max_tokens", "max_output_tokens"):
            if isinstance(case.body, dict) and isinstance(case.body.get(cap), int):
                case.body[cap] = min(case.body[cap], 64)  # keep the stub's answers short
        response = case.call(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert "error" in response.json()

    check()
