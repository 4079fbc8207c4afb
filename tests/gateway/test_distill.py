"""The distillation set through a running gateway: a cascade that escalated and an ensemble that
agreed leave a fine-tuning example for a tenant that opted in, and nothing at all for one that did
not; `tokenops distill export` writes them as OpenAI chat JSONL with tenant, model and date filters.
Two bench stubs stand for the providers ("cheap" answers with a set log-prob, "strong" a set text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from gateway_harness import RunningGateway, gateway_settings, start_gateway
from typer.testing import CliRunner

from tokenops.bench.stub import StubConfig, run_stub_in_thread
from tokenops.cli import app as cli_app
from tokenops.ops.db import engine_url
from tokenops.ops.models import distill_examples

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, StubConfig]]:
    out, stops = {}, []
    for name, reply in (("cheap", "Paris"), ("strong", "Paris")):
        cfg = StubConfig(models=[name], prefix_cache=False, reply=reply)
        url, stop = run_stub_in_thread(cfg)
        out[name] = cfg
        cfg.url = url  # type: ignore[attr-defined]
        stops.append(stop)
    yield out
    for stop in stops:
        stop()


@pytest.fixture(scope="module")
def gw(stubs: dict[str, StubConfig], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    models = {name: {"backends": [cfg.url + "/v1"]} for name, cfg in stubs.items()}  # type: ignore[attr-defined]
    routes = {
        "cascaded": {
            "cheap": "cheap",
            "strong": "strong",
            "strategy": "cascade",
            "cascade": {"min_logprob": -1.0},
        },
        "vote": {"cheap": "cheap", "strong": "strong", "strategy": "ensemble"},
    }
    settings = gateway_settings(
        stubs["cheap"].url,  # type: ignore[attr-defined]
        tmp_path_factory.mktemp("distill"),
        models=models,
        routes=routes,
        cache={"enabled": False},
        distill={"tenants": ["opted"]},
    )
    running = start_gateway(settings)
    yield running
    running.stop()


def examples(gw: RunningGateway) -> list[dict[str, Any]]:
    engine = sa.create_engine(engine_url(gw.settings.resolved_database_url))
    try:
        with engine.connect() as conn:
            t = distill_examples
            rows = conn.execute(sa.select(t).order_by(t.c.id))
            return [dict(r._mapping) for r in rows]
    finally:
        engine.dispose()


KEYS: dict[str, str] = {}


def ask(gw: RunningGateway, tenant: str, model: str) -> str:
    if tenant not in KEYS:
        KEYS[tenant] = gw.new_key("k", org=tenant)
    client: openai.OpenAI = gw.client(KEYS[tenant])
    return client.chat.completions.create(model=model, messages=QUESTION).choices[0].message.content


def test_nothing_is_recorded_for_a_tenant_that_did_not_opt_in(gw: RunningGateway, stubs) -> None:
    stubs["cheap"].logprob = -3.0  # the cascade escalates
    assert ask(gw, "quiet", "cascaded").strip() == "Paris"
    stubs["cheap"].logprob = -0.05
    assert ask(gw, "quiet", "vote").strip() == "Paris"  # both members agree
    assert gw.wait_ledger(2, tenant="quiet")[-1]["route"].startswith("route=vote")
    assert [e for e in examples(gw) if e["tenant"] == "quiet"] == []


def test_an_accepted_cheap_answer_is_not_recorded(gw: RunningGateway, stubs) -> None:
    stubs["cheap"].logprob = -0.05
    before = len(examples(gw))
    ask(gw, "opted", "cascaded")
    gw.wait_ledger(1, tenant="opted")
    assert len(examples(gw)) == before


def test_escalations_and_agreements_are_recorded_and_exported(
    gw: RunningGateway, stubs, tmp_path: Path
) -> None:
    rows = len(gw.ledger(tenant="opted")) if "opted" in KEYS else 0
    stubs["strong"].reply = "Paris is the capital"
    stubs["cheap"].logprob = -3.0
    ask(gw, "opted", "cascaded")
    stubs["cheap"].logprob = -0.05
    stubs["strong"].reply = "Paris"
    ask(gw, "opted", "vote")
    # an example is recorded after its answer is sent, before its ledger row is written
    gw.wait_ledger(rows + 2, tenant="opted")
    kept = [e for e in examples(gw) if e["tenant"] == "opted"]
    assert [(e["route"], e["reason"], e["model"]) for e in kept] == [
        ("cascaded", "escalated", "strong"),
        ("vote", "agreed", "strong"),
    ]
    assert kept[0]["messages"] == [*QUESTION, {"role": "assistant", "content": "Paris is the capital "}]

    out = tmp_path / "set.jsonl"
    db = gw.settings.resolved_database_url
    runner = CliRunner()
    r = runner.invoke(
        cli_app, ["distill", "export", "--out", str(out), "--tenant", "opted", "--database-url", db]
    )
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [{"messages": e["messages"]} for e in kept]
    assert lines[0]["messages"][-1]["role"] == "assistant"

    r = runner.invoke(
        cli_app, ["distill", "export", "-o", str(out), "--model", "cheap", "--database-url", db]
    )
    assert r.exit_code == 0 and out.read_text() == ""
    r = runner.invoke(
        cli_app, ["distill", "export", "-o", str(out), "--since", "2999-01-01", "--database-url", db]
    )
    assert r.exit_code == 0 and out.read_text() == ""
    r = runner.invoke(
        cli_app, ["distill", "export", "-o", str(out), "--tenant", "quiet", "--database-url", db]
    )
    assert r.exit_code == 0 and out.read_text() == ""
