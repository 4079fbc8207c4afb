"""An agent session on `/v1/responses` against a real engine server (the tiny random Llama of
tests/conftest.py, one token per byte, a 384-token context window), with the official `openai` SDK.

Each round continues the previous one by `previous_response_id`: the engine's prefix cache serves the
resent history, and once the session would outgrow its budget the gateway compacts it (a metered
call of its own, `operation=compaction`), so the session runs on well past the context window.
"""

from __future__ import annotations

import pytest
from gateway_harness import gateway_settings, start_gateway

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-agent"
WINDOW = 384
ROUNDS = 12
INSTRUCTIONS = "You are a terse agent."


@pytest.fixture(scope="module")
def engine_url(thinker):
    loaded = thinker("r1")
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(block_size=4, num_kv_blocks=1024, max_num_batched_tokens=128, max_model_len=WINDOW),
    )
    config = ServerConfig(served_model_names=[MODEL], max_model_len=WINDOW)
    with serve_in_thread(build_app(engine, loaded.tokenizer, config)) as url:
        yield url


@pytest.fixture(scope="module")
def gw(engine_url, tmp_path_factory):
    settings = gateway_settings(
        engine_url,
        tmp_path_factory.mktemp("gw-agent"),
        models={
            MODEL: {"backends": [engine_url + "/v1"], "context_window": WINDOW, "pricing": {"input": 1.0}}
        },
        responses={"summary_tokens": 24},
        cache={"enabled": False},
    )
    gateway = start_gateway(settings)
    yield gateway
    gateway.stop()


def test_a_long_session_is_served_from_the_prefix_cache_and_compacted_past_the_window(gw) -> None:
    client = gw.client(gw.new_key("agent", org="agents"), timeout=300)
    previous = None
    rounds = []
    compacted = []  # whether the gateway compacted the session before each round
    for k in range(ROUNDS):
        before = len(gw.ledger(operation="compaction"))
        r = client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=f"Round {k}: the tool said the value is {k * 7}. What next?",
            max_output_tokens=12,
            temperature=0,
            previous_response_id=previous,
        )
        assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
        rounds.append(r.usage)
        compacted.append(len(gw.ledger(operation="compaction")) > before)
        previous = r.id
    # every round fitted the window, though the session's turns together are far longer
    assert all(u.input_tokens + u.output_tokens <= WINDOW for u in rounds)
    assert sum(u.input_tokens for u in rounds) > 3 * WINDOW
    compactions = gw.ledger(operation="compaction")
    assert compactions, "the session never compacted"
    assert all(
        c["status"] == "ok" and c["uncached_input_tokens"] + c["cached_input_tokens"] > 0 for c in compactions
    )
    assert len(gw.ledger(operation="responses")) == ROUNDS
    # a round that only appended to the history found the rest of it in the prefix cache
    shares = [u.input_tokens_details.cached_tokens / u.input_tokens for u in rounds]
    appending = [share for k, share in enumerate(shares) if k > 0 and not compacted[k]]
    assert appending and all(share > 0.5 for share in appending), (shares, compacted)
    # the session survives the compaction: its latest response can still be continued
    last = client.responses.create(
        model=MODEL, input="Done?", max_output_tokens=4, previous_response_id=previous
    )
    assert last.previous_response_id == previous
