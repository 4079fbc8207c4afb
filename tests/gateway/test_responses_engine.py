"""An agent session on `/v1/responses` against a real engine server (the tiny random Llama of
tests/conftest.py, one token per byte, a 384-token context window), with the official `openai` SDK.

Each round continues the previous one by `previous_response_id`: the engine's prefix cache serves the
resent history, and once the session would outgrow its budget the gateway compacts it (a metered
call of its own, `operation=compaction`), so the session runs on well past the context window.

The model writes ASCII only and never ends a turn by itself, so every answer and summary has exactly
its `max_tokens` tokens: the token counts below are the same on every run, whatever the load.
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
BLOCK = 4  # the engine's KV block size: the prefix cache serves whole blocks
ROUNDS = 12
INSTRUCTIONS = "You are a terse agent."


@pytest.fixture(scope="module")
def engine_url(thinker):
    loaded = thinker("qwen3")  # it answers without thinking: answers and summaries are content
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(block_size=BLOCK, num_kv_blocks=1024, max_num_batched_tokens=128, max_model_len=WINDOW),
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
    for k in range(ROUNDS):
        r = client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=f"Round {k}: {k * 7}?",
            max_output_tokens=12,
            temperature=0,
            previous_response_id=previous,
        )
        assert r.status in ("completed", "incomplete") and r.usage.output_tokens == 12
        rounds.append(r.usage)
        previous = r.id
    # every round fitted the window, though the session's turns together are far longer
    assert all(u.input_tokens + u.output_tokens <= WINDOW for u in rounds)
    assert sum(u.input_tokens for u in rounds) > 3 * WINDOW
    # a round that only appended to the history finds all of the previous round in the prefix cache:
    # its prompt and its answer, in whole blocks (the answer's last token was sampled, never computed)
    counts = [(u.input_tokens, u.input_tokens_details.cached_tokens) for u in rounds]
    missed = [
        k
        for k in range(1, ROUNDS)
        if rounds[k].input_tokens_details.cached_tokens
        < (rounds[k - 1].input_tokens + rounds[k - 1].output_tokens - 1) // BLOCK * BLOCK
    ]
    appending = [k for k in range(1, ROUNDS) if k not in missed]
    assert all(counts[k][1] > 0.5 * counts[k][0] for k in appending), counts
    # the rounds that did not were those the gateway compacted first, one summary call each; a
    # compaction leaves room for rounds that only append again
    compactions = gw.wait_ledger(len(missed), timeout=60, operation="compaction")
    assert missed and len(compactions) == len(missed), (counts, len(compactions))
    assert len(appending) >= max(ROUNDS // 2, 2 * len(missed)), counts
    assert all(
        c["status"] == "ok" and c["uncached_input_tokens"] + c["cached_input_tokens"] > 0 for c in compactions
    )
    assert len(gw.wait_ledger(ROUNDS, timeout=60, operation="responses")) == ROUNDS
    # the session survives the compaction: its latest response can still be continued
    last = client.responses.create(
        model=MODEL, input="Done?", max_output_tokens=4, previous_response_id=previous
    )
    assert last.previous_response_id == previous
