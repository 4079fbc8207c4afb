"""Profile the real bundled SmolLM2 engine on a few items of one suite (slow: `-m bundled`)."""

from __future__ import annotations

import asyncio

import pytest

from tokenops.fusion.profiles import ModelEndpoint, aggregate, run_items
from tokenops.fusion.suites import generate_suite


@pytest.mark.bundled
@pytest.mark.timeout(300)
def test_profile_bundled_smollm2_on_knowledge_items() -> None:
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

    loaded = load_model("smollm2-135m-instruct")
    engine = LLMEngine.from_loaded(loaded, EngineConfig(max_model_len=2048))
    app = build_app(
        engine, loaded.tokenizer, ServerConfig(served_model_names=[loaded.name], max_model_len=2048)
    )
    items = generate_suite(0, categories=["knowledge"], levels=[1], per_cell=3)
    with serve_in_thread(app) as url:
        ep = ModelEndpoint(loaded.name, f"{url}/v1", input_price=0.1, output_price=0.2)
        results = asyncio.run(run_items(ep, items, concurrency=3))
    assert all(r.error is None for r in results), [r.error for r in results]
    assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 and r.cost > 0 for r in results)
    profile = aggregate(loaded.name, "bundled", results)
    # SmolLM2-135M knows the capitals of large countries; at least some answers must check out
    assert profile.cells[("knowledge", 1)].accuracy > 0, [r.output for r in results]
