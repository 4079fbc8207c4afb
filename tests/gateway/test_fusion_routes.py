"""Cascades and ensembles through the running gateway, with the official openai SDK, against three
stub replicas that answer set texts with set token log-probabilities (or fail on purpose).

Prices per million tokens (= micro-units per token): cheap 1 in / 2 out, mid 3 / 6, strong 10 / 20.
The stub counts one token per word, so every cost below is exact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import RunningGateway, gateway_settings, start_gateway

from tokenops.bench.stub import StubConfig, run_stub_in_thread

PRICES = {"cheap": (1, 2), "mid": (3, 6), "strong": (10, 20)}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_WORDS = 6  # the stub's prompt tokens for QUESTION


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, tuple[str, StubConfig]]]:
    out: dict[str, tuple[str, StubConfig]] = {}
    stops = []
    for name in PRICES:
        cfg = StubConfig(models=[name], prefix_cache=False)
        url, stop = run_stub_in_thread(cfg)
        out[name] = (url, cfg)
        stops.append(stop)
    yield out
    for stop in stops:
        stop()


@pytest.fixture(autouse=True)
def answers(stubs: dict[str, tuple[str, StubConfig]]) -> dict[str, StubConfig]:
    """Each test starts from: cheap says "Paris" confidently, mid "Paris", strong "Paris is the capital"
    (`replies` scripts the next answers of one stub, one per request)."""
    replies = {"cheap": "Paris", "mid": "Paris", "strong": "Paris is the capital"}
    for name, (_, cfg) in stubs.items():
        cfg.reply, cfg.logprob, cfg.fail_status, cfg.fail_count = replies[name], -0.05, None, None
        cfg.replies = []
    return {name: cfg for name, (_, cfg) in stubs.items()}


@pytest.fixture(scope="module")
def gw(
    stubs: dict[str, tuple[str, StubConfig]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    models = {
        name: {
            "backends": [stubs[name][0] + "/v1"],
            "template_overhead_tokens": 16,
            "pricing": {"input": p_in, "output": p_out},
        }
        for name, (p_in, p_out) in PRICES.items()
    }
    cascade = {
        "cheap": "cheap",
        "strong": "strong",
        "strategy": "cascade",
        "target_strong_share": 0,
        "cascade": {"min_logprob": -1.0, "reject_patterns": ["(?i)i don't know"]},
    }
    routes = {
        "auto": {"cheap": "cheap", "strong": "strong", "strategy": "route", "router": "rules"},
        "cascaded": cascade,
        "agreeing": {**cascade, "cascade": {"samples": 2, "min_agreement": 0.67, "temperature": 0.7}},
        "verified": {**cascade, "cascade": {"verifier": "mid"}},
        "vote": {
            "cheap": "cheap",
            "strong": "strong",
            "strategy": "ensemble",
            "ensemble": {"models": ["cheap", "mid", "strong"]},
        },
        "judged": {
            "cheap": "cheap",
            "strong": "strong",
            "strategy": "ensemble",
            "ensemble": {"models": ["cheap", "strong"], "aggregate": "judge", "judge": "mid"},
        },
        "learning": {
            **cascade,
            "learn": {"tenants": ["learner", "distiller"], "answer_tenants": ["distiller"]},
        },
        # retrained from its own outcomes while the gateway serves, saved for a restart
        "relearning": {
            **cascade,
            "router_model": str(tmp_path_factory.mktemp("relearn") / "router.npz"),
            "learn": {"tenants": ["teacher"], "retrain": {"every_s": 0.2, "min_new_outcomes": 24}},
        },
        "thinking": {
            "cheap": "cheap",
            "strong": "strong",
            "router": "rules",
            "reasoning": {"tenant_caps": {"think-free": "low"}},
        },
        "best": {
            "cheap": "cheap",
            "strong": "strong",
            "strategy": "ensemble",
            "ensemble": {"aggregate": "best_of_n", "samples": 3, "scorer": "judge", "judge": "mid"},
        },
        "consistent": {
            "cheap": "cheap",
            "strong": "strong",
            "strategy": "ensemble",
            "ensemble": {"models": ["cheap"], "aggregate": "self_consistency", "samples": 6, "agree": 3},
        },
    }
    cluster = {"retry": {"attempts": 1, "backoff_base_s": 0.0}, "breaker": {"failure_threshold": 1000}}
    settings = gateway_settings(
        stubs["cheap"][0], tmp_path_factory.mktemp("fusion"), models=models, routes=routes, cluster=cluster
    )
    running = start_gateway(settings)
    yield running
    running.stop()


def served(stubs: dict[str, tuple[str, StubConfig]]) -> dict[str, int]:
    return {name: httpx.get(url + "/stub/stats").json()["requests"] for name, (url, _) in stubs.items()}


def cost(model: str, prompt: int, output: int) -> int:
    p_in, p_out = PRICES[model]
    return prompt * p_in + output * p_out


def client_for(gw: RunningGateway, tenant: str, limits: dict[str, Any] | None = None) -> openai.OpenAI:
    return gw.client(gw.new_key("k", limits, org=tenant))


def test_cascade_accepted_at_the_cheap_model_is_one_call_billed_at_cheap_prices(gw, stubs) -> None:
    before = served(stubs)
    raw = client_for(gw, "accept").chat.completions.with_raw_response.create(
        model="cascaded", messages=QUESTION
    )
    answer = raw.parse()
    assert answer.choices[0].message.content.strip() == "Paris"
    assert answer.choices[0].logprobs is None  # asked upstream for the check, not by the client
    assert raw.headers["x-tokenops-model"] == "cheap"
    route = raw.headers["x-tokenops-route"]
    assert route.startswith("route=cascaded; strategy=cascade;") and route.endswith("tried=cheap(accepted)")
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 1 and after["strong"] == before["strong"]
    row = gw.wait_ledger(1, tenant="accept")[0]
    assert row["model_served"] == "cheap" and row["status"] == "ok" and row["route"] == route
    assert (row["uncached_input_tokens"], row["output_tokens"]) == (PROMPT_WORDS, 1)
    assert row["cost_micros"] == cost("cheap", PROMPT_WORDS, 1)


def test_cascade_escalates_on_low_confidence_and_bills_both_calls(gw, stubs, answers) -> None:
    answers["cheap"].logprob = -3.0
    before = served(stubs)
    raw = client_for(gw, "escalate").chat.completions.with_raw_response.create(
        model="cascaded", messages=QUESTION
    )
    assert raw.parse().choices[0].message.content.strip() == "Paris is the capital"
    assert raw.headers["x-tokenops-model"] == "strong"
    route = raw.headers["x-tokenops-route"]
    assert "tried=cheap(rejected: low confidence: log-prob q0.1 -3.00 < -1) -> strong(answered)" in route
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 1 and after["strong"] == before["strong"] + 1
    row = gw.wait_ledger(1, tenant="escalate")[0]
    assert row["model_served"] == "strong" and row["status"] == "ok" and row["route"] == route
    assert row["uncached_input_tokens"] == 2 * PROMPT_WORDS and row["output_tokens"] == 1 + 4
    assert row["cost_micros"] == cost("cheap", PROMPT_WORDS, 1) + cost("strong", PROMPT_WORDS, 4)


def test_cascade_rules_reject_a_refusal(gw, answers) -> None:
    answers["cheap"].reply = "I don't know"
    raw = client_for(gw, "rules").chat.completions.with_raw_response.create(
        model="cascaded", messages=QUESTION
    )
    assert raw.headers["x-tokenops-model"] == "strong"
    assert "cheap(rejected: matched rule /(?i)i don't know/)" in raw.headers["x-tokenops-route"]


def test_a_verifier_that_says_no_escalates_and_its_call_is_billed(gw, stubs, answers) -> None:
    answers["mid"].reply = "no"
    raw = client_for(gw, "verify").chat.completions.with_raw_response.create(
        model="verified", messages=QUESTION
    )
    assert raw.headers["x-tokenops-model"] == "strong"
    assert "cheap(rejected: verifier mid said no) -> strong(answered)" in raw.headers["x-tokenops-route"]
    row = gw.wait_ledger(1, tenant="verify")[0]
    verifier_prompt = row["uncached_input_tokens"] - 2 * PROMPT_WORDS
    assert verifier_prompt > PROMPT_WORDS  # the question and the proposed answer
    assert row["cost_micros"] == (
        cost("cheap", PROMPT_WORDS, 1) + cost("mid", verifier_prompt, 1) + cost("strong", PROMPT_WORDS, 4)
    )

    answers["mid"].reply = "yes"
    raw = client_for(gw, "verify-yes").chat.completions.with_raw_response.create(
        model="verified", messages=QUESTION
    )
    assert raw.headers["x-tokenops-model"] == "cheap" and raw.headers["x-tokenops-route"].endswith(
        "cheap(accepted)"
    )


def test_streaming_cascade_streams_the_final_answer(gw, stubs, answers) -> None:
    client = client_for(gw, "stream")
    # accepted at the cheap model: its buffered answer is replayed as SSE
    chunks = list(client.chat.completions.create(model="cascaded", messages=QUESTION, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Paris"
    # escalated: the strong model's stream is relayed live, usage included when asked
    answers["cheap"].logprob = -3.0
    with client.chat.completions.with_streaming_response.create(
        model="cascaded", messages=QUESTION, stream=True, stream_options={"include_usage": True}
    ) as resp:
        assert resp.headers["x-tokenops-model"] == "strong"
        assert resp.headers["x-tokenops-route"].endswith("-> strong(answered, streamed)")
        chunks = list(resp.parse())
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        == "Paris is the capital"
    )
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    )  # the answering call's usage
    rows = gw.wait_ledger(2, tenant="stream")
    assert [r["model_served"] for r in rows] == ["cheap", "strong"] and all(r["status"] == "ok" for r in rows)
    assert rows[1]["cost_micros"] == cost("cheap", PROMPT_WORDS, 1) + cost("strong", PROMPT_WORDS, 4)


def test_a_failing_cheap_model_falls_back_to_the_next_tier(gw, answers) -> None:
    answers["cheap"].fail_status = 500
    raw = client_for(gw, "fallback").chat.completions.with_raw_response.create(
        model="cascaded", messages=QUESTION
    )
    assert raw.headers["x-tokenops-model"] == "strong"
    assert "tried=cheap(failed: upstream_failed) -> strong(answered)" in raw.headers["x-tokenops-route"]
    row = gw.wait_ledger(1, tenant="fallback")[0]
    assert row["status"] == "ok" and row["cost_micros"] == cost(
        "strong", PROMPT_WORDS, 4
    )  # the failure is free


def test_the_last_tier_failing_is_a_clear_error_and_the_rejected_step_is_still_billed(gw, answers) -> None:
    answers["cheap"].logprob = -3.0
    answers["strong"].fail_status = 500
    with pytest.raises(openai.APIStatusError) as e:
        client_for(gw, "broken").chat.completions.create(model="cascaded", messages=QUESTION)
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_failed"
    row = gw.wait_ledger(1, tenant="broken")[0]
    assert row["status"] == "upstream_error" and row["http_status"] == 502
    assert row["cost_micros"] == cost("cheap", PROMPT_WORDS, 1)
    assert "cheap(rejected: low confidence" in row["route"] and row["route"].endswith(
        "strong(failed: upstream_failed)"
    )


def test_ensemble_majority_vote(gw, stubs, answers) -> None:
    answers["strong"].reply = "Lyon"
    before = served(stubs)
    raw = client_for(gw, "vote").chat.completions.with_raw_response.create(model="vote", messages=QUESTION)
    assert raw.parse().choices[0].message.content.strip() == "Paris"
    assert raw.headers["x-tokenops-model"] == "mid"  # ties among the winners go to the latest member
    route = raw.headers["x-tokenops-route"]
    assert "tried=cheap(not picked) -> mid(answered, 2 of 3 votes) -> strong(not picked)" in route
    after = served(stubs)
    assert all(after[m] == before[m] + 1 for m in PRICES)
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'tokenops_fusion_steps_total{model="mid",outcome="answered",route="vote"}' in metrics
    row = gw.wait_ledger(1, tenant="vote")[0]
    assert row["model_served"] == "mid" and row["uncached_input_tokens"] == 3 * PROMPT_WORDS
    assert row["cost_micros"] == cost("cheap", PROMPT_WORDS, 1) + cost("mid", PROMPT_WORDS, 1) + cost(
        "strong", PROMPT_WORDS, 1
    )


def test_ensemble_judge_picks_and_streams(gw, answers) -> None:
    answers["mid"].reply = "2"
    client = client_for(gw, "judge")
    chunks = list(client.chat.completions.create(model="judged", messages=QUESTION, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        == "Paris is the capital"
    )
    row = gw.wait_ledger(1, tenant="judge")[0]
    assert row["model_served"] == "strong" and "strong(answered, picked by judge mid)" in row["route"]


def test_a_budget_below_the_worst_case_of_every_step_is_refused_before_any_call(gw, stubs) -> None:
    # a cascade reserves prompt x (1 + 10) + 1 x (2 + 20) at least: 26 prompt tokens bound "hi" -> 308;
    # the strong model alone would need 280, which fits
    client = client_for(gw, "poor", {"budget_micros": 300, "budget_period": "total"})
    before = served(stubs)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="cascaded", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "insufficient_quota" and "308" in e.value.body["message"]
    assert served(stubs) == before and gw.ledger(tenant="poor") == []
    ok = client.chat.completions.create(
        model="strong", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert ok.choices[0].finish_reason == "length"


def test_text_completion_cascade_reads_token_logprobs(gw, answers) -> None:
    client = client_for(gw, "text")
    raw = client.completions.with_raw_response.create(model="cascaded", prompt="The capital of France is")
    assert raw.headers["x-tokenops-model"] == "cheap" and raw.parse().choices[0].logprobs is None
    answers["cheap"].logprob = -2.0
    raw = client.completions.with_raw_response.create(
        model="cascaded", prompt="The capital of France is", logprobs=0
    )
    answer = raw.parse()
    assert (
        raw.headers["x-tokenops-model"] == "strong"
        and answer.choices[0].text.strip() == "Paris is the capital"
    )


def test_route_config_names_only_configured_models(tmp_path) -> None:
    from tokenops.config import ConfigError, load_settings

    models = {m: {"backends": ["http://127.0.0.1:1/v1"]} for m in PRICES}

    def load(route: dict[str, Any]) -> Any:
        return load_settings(
            None, environ={}, overrides={"data_dir": tmp_path, "models": models, "routes": {"r": route}}
        )

    base = {"cheap": "cheap", "strong": "strong"}
    with pytest.raises(ConfigError, match="'nope', which is not under models"):
        load({**base, "strategy": "cascade", "cascade": {"verifier": "nope"}})
    with pytest.raises(ConfigError, match="not a regular expression"):
        load({**base, "strategy": "cascade", "cascade": {"reject_patterns": ["("]}})
    with pytest.raises(ConfigError, match="strategy"):
        load({**base, "strategy": "majority"})
    with pytest.raises(ConfigError, match="'cascade' settings need strategy: cascade"):
        load({**base, "cascade": {"min_logprob": -1}})
    with pytest.raises(ConfigError, match="one is enough for self_consistency"):
        load({**base, "strategy": "ensemble", "ensemble": {"models": ["cheap"]}})
    with pytest.raises(ConfigError, match="min_agreement"):
        load({**base, "strategy": "cascade", "cascade": {"samples": 2, "min_agreement": 0}})
    s = load({**base, "strategy": "ensemble", "ensemble": {"aggregate": "self_consistency"}})
    assert s.routes["r"].ensemble.models is None and s.routes["r"].ensemble.samples == 8
    s = load({**base, "strategy": "ensemble", "ensemble": {"aggregate": "judge"}})
    assert s.routes["r"].ensemble.judge == "strong"  # the strong model judges unless told otherwise
    bon = {**base, "strategy": "ensemble"}
    with pytest.raises(ConfigError, match="ensemble.models takes exactly one"):
        load({**bon, "ensemble": {"aggregate": "best_of_n", "models": ["cheap", "mid"]}})
    with pytest.raises(ConfigError, match="needs ensemble.verifier"):
        load({**bon, "ensemble": {"aggregate": "best_of_n", "scorer": "verifier"}})
    with pytest.raises(ConfigError, match="'nope', which is not under models"):
        load({**bon, "ensemble": {"aggregate": "best_of_n", "scorer": "verifier", "verifier": "nope"}})
    with pytest.raises(ConfigError, match="low_at must not exceed"):
        load({**base, "reasoning": {"low_at": 0.9, "high_at": 0.1}})
    with pytest.raises(ConfigError, match="'learn' needs strategy: cascade"):
        load({**base, "learn": {"tenants": ["a"]}})
    with pytest.raises(ConfigError, match="must also be in learn.tenants"):
        load({**base, "strategy": "cascade", "learn": {"tenants": ["a"], "answer_tenants": ["b"]}})


def test_cascade_samples_that_disagree_escalate_and_every_sample_is_billed(gw, stubs, answers) -> None:
    answers["cheap"].replies = ["Paris", "Lyon", "Marseille"]  # the answer, then two samples
    before = served(stubs)
    raw = client_for(gw, "disagree").chat.completions.with_raw_response.create(
        model="agreeing", messages=QUESTION
    )
    assert raw.parse().choices[0].message.content.strip() == "Paris is the capital"
    assert raw.headers["x-tokenops-model"] == "strong"
    route = raw.headers["x-tokenops-route"]
    assert "tried=cheap(rejected: agreement 0.33 < 0.67) -> strong(answered)" in route
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 3 and after["strong"] == before["strong"] + 1
    row = gw.wait_ledger(1, tenant="disagree")[0]
    assert row["model_served"] == "strong" and row["route"] == route
    assert row["uncached_input_tokens"] == 4 * PROMPT_WORDS and row["output_tokens"] == 3 + 4
    assert row["cost_micros"] == 3 * cost("cheap", PROMPT_WORDS, 1) + cost("strong", PROMPT_WORDS, 4)


def test_cascade_samples_that_agree_after_normalising_accept_the_cheap_answer(gw, stubs, answers) -> None:
    answers["cheap"].replies = ["Paris", "paris.", "PARIS!"]
    client = client_for(gw, "agree")
    before = served(stubs)
    raw = client.chat.completions.with_raw_response.create(model="agreeing", messages=QUESTION)
    assert raw.parse().choices[0].message.content.strip() == "Paris"  # the first answer, as written
    assert raw.headers["x-tokenops-model"] == "cheap"
    assert raw.headers["x-tokenops-route"].endswith("tried=cheap(accepted)")
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 3 and after["strong"] == before["strong"]
    row = gw.wait_ledger(1, tenant="agree")[0]
    assert row["model_served"] == "cheap" and row["cost_micros"] == 3 * cost("cheap", PROMPT_WORDS, 1)

    # one sample that disagrees: 2 of 3 is 0.666..., below 0.67
    answers["cheap"].replies = ["Paris", "Paris", "Lyon"]
    raw = client.chat.completions.with_raw_response.create(model="agreeing", messages=QUESTION)
    assert "cheap(rejected: agreement 0.67 < 0.67)" in raw.headers["x-tokenops-route"]


def test_the_reservation_of_a_sampling_cascade_includes_its_samples(gw, stubs) -> None:
    # the plain cascade reserves 308 for "hi" (see the budget test above); two samples of the cheap
    # model add 2 x (26 x 1 + 1 x 2) = 56
    client = client_for(gw, "poor-samples", {"budget_micros": 350, "budget_period": "total"})
    before = served(stubs)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="agreeing", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "insufficient_quota" and "364" in e.value.body["message"]
    assert served(stubs) == before
    client.chat.completions.create(model="cascaded", messages=[{"role": "user", "content": "hi"}])


def test_self_consistency_stops_once_enough_samples_agree(gw, stubs, answers) -> None:
    # rounds of two: (Paris, Lyon) leads 1-1, (Paris, Paris) gives Paris its third vote: stop at 4 of 6
    answers["cheap"].replies = ["Paris", "Lyon", "Paris", "Paris"]
    answers["cheap"].reply = "Nice"  # what a fifth sample would say
    before = served(stubs)
    raw = client_for(gw, "sc").chat.completions.with_raw_response.create(
        model="consistent", messages=QUESTION
    )
    assert raw.parse().choices[0].message.content.strip() == "Paris"
    assert raw.headers["x-tokenops-model"] == "cheap"
    route = raw.headers["x-tokenops-route"]
    assert route.startswith("route=consistent; strategy=ensemble; reason=ensemble (self_consistency)")
    assert route.endswith("tried=cheap(answered, 3 of 4 votes, stopped early (max 6))")
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 4 and after["strong"] == before["strong"]
    row = gw.wait_ledger(1, tenant="sc")[0]
    assert row["model_served"] == "cheap" and row["route"] == route
    assert (row["uncached_input_tokens"], row["output_tokens"]) == (4 * PROMPT_WORDS, 4)
    assert row["cost_micros"] == 4 * cost("cheap", PROMPT_WORDS, 1)


def test_self_consistency_without_a_consensus_draws_every_sample_and_streams_the_leader(
    gw, stubs, answers
) -> None:
    answers["cheap"].replies = ["Lyon", "Nice", "Paris", "Paris", "Lille", "Metz"]
    before = served(stubs)
    chunks = list(
        client_for(gw, "sc-all").chat.completions.create(model="consistent", messages=QUESTION, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Paris"
    assert served(stubs)["cheap"] == before["cheap"] + 6
    row = gw.wait_ledger(1, tenant="sc-all")[0]
    assert row["route"].endswith("cheap(answered, 2 of 6 votes)")
    assert row["cost_micros"] == 6 * cost("cheap", PROMPT_WORDS, 1)


def test_auto_routes_easy_requests_to_the_cheap_model_and_hard_ones_to_the_strong(gw, stubs) -> None:
    client = client_for(gw, "auto")
    before = served(stubs)
    easy = client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION)
    assert easy.headers["x-tokenops-model"] == "cheap"
    assert easy.headers["x-tokenops-route"] == "route=auto; model=cheap; reason=rules score 0.20 <= 0.50"
    assert easy.parse().choices[0].message.content.strip() == "Paris"
    # the client declares a hard task
    math = client.chat.completions.with_raw_response.create(
        model="auto", messages=QUESTION, extra_headers={"x-tokenops-task": "math"}
    )
    assert math.headers["x-tokenops-model"] == "strong"
    assert math.headers["x-tokenops-route"] == "route=auto; model=strong; reason=rules score 0.90 > 0.50"
    # tools present
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    tooled = client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION, tools=tools)
    assert tooled.headers["x-tokenops-model"] == "strong"
    after = served(stubs)
    assert after["cheap"] == before["cheap"] + 1 and after["strong"] == before["strong"] + 2
    rows = gw.wait_ledger(3, tenant="auto")
    assert [r["model_served"] for r in rows] == ["cheap", "strong", "strong"]
    assert [r["route"] for r in rows] == [
        easy.headers["x-tokenops-route"],
        math.headers["x-tokenops-route"],
        tooled.headers["x-tokenops-route"],
    ]
    assert rows[0]["cost_micros"] == cost("cheap", PROMPT_WORDS, 1)
    assert rows[1]["cost_micros"] == cost("strong", PROMPT_WORDS, 4)


def test_best_of_n_is_one_call_with_n_and_every_sample_is_billed(gw, stubs, answers) -> None:
    from tokenops.fusion.strategies import judge_prompt

    answers["cheap"].replies = ["Lyon", "Paris", "Nice"]  # the three choices of one call
    answers["mid"].reply = "2"  # the judge picks the second
    before = served(stubs)
    raw = client_for(gw, "bon").chat.completions.with_raw_response.create(model="best", messages=QUESTION)
    answer = raw.parse()
    assert [c.message.content.strip() for c in answer.choices] == ["Paris"]
    route = raw.headers["x-tokenops-route"]
    assert route.endswith("tried=cheap(answered, sample 2 of 3, picked by judge mid)"), route
    after = served(stubs)
    assert (after["cheap"], after["mid"]) == (before["cheap"] + 1, before["mid"] + 1)
    row = gw.wait_ledger(1, tenant="bon")[0]
    judge_words = len(judge_prompt(QUESTION[0]["content"], ["Lyon ", "Paris ", "Nice "]).split())
    # the prompt once, all three samples' tokens, and the judge's call at its own price
    assert (row["uncached_input_tokens"], row["output_tokens"]) == (PROMPT_WORDS + judge_words, 3 + 1)
    assert row["cost_micros"] == cost("cheap", PROMPT_WORDS, 3) + cost("mid", judge_words, 1)


def test_reasoning_effort_follows_the_score_within_the_tenants_cap(gw, stubs) -> None:
    def last(name: str) -> str | None:
        return httpx.get(stubs[name][0] + "/stub/stats").json()["last_reasoning_effort"]

    math = {"x-tokenops-task": "math"}
    paid = client_for(gw, "think-paid")
    hard = paid.chat.completions.with_raw_response.create(
        model="thinking", messages=QUESTION, extra_headers=math
    )
    assert hard.headers["x-tokenops-route"].endswith("reason=rules score 0.90 > 0.50; reasoning=high")
    assert last("strong") == "high"
    easy = paid.chat.completions.with_raw_response.create(model="thinking", messages=QUESTION)
    assert easy.headers["x-tokenops-route"].endswith("; reasoning=off") and last("cheap") == "none"
    capped = client_for(gw, "think-free")
    free = capped.chat.completions.with_raw_response.create(
        model="thinking", messages=QUESTION, extra_headers=math
    )
    assert free.headers["x-tokenops-route"].endswith("; reasoning=low (capped)") and last("strong") == "low"
    # a client asking for more than its cap gets the cap
    asked = capped.chat.completions.with_raw_response.create(
        model="thinking", messages=QUESTION, reasoning_effort="high"
    )
    assert asked.headers["x-tokenops-route"].endswith("; reasoning=low (capped)") and last("cheap") == "low"
    rows = gw.wait_ledger(2, tenant="think-paid")
    assert [r["route"].rsplit("; ", 1)[1] for r in rows] == ["reasoning=high", "reasoning=off"]
    assert gw.wait_ledger(2, tenant="think-free")[0]["route"].endswith("reasoning=low (capped)")


def test_a_learning_cascade_keeps_its_verdicts_for_opted_in_tenants_only(gw, answers) -> None:
    import time

    from tokenops.fusion.outcomes import OutcomeStore

    learner = client_for(gw, "learner")
    learner.chat.completions.create(model="learning", messages=QUESTION)  # accepted at the cheap tier
    answers["cheap"].logprob = -3.0
    learner.chat.completions.create(model="learning", messages=QUESTION)  # escalated
    client_for(gw, "distiller").chat.completions.create(model="learning", messages=QUESTION)
    client_for(gw, "stranger").chat.completions.create(model="learning", messages=QUESTION)  # not opted in
    store = OutcomeStore(gw.settings.resolved_database_url)
    deadline = time.monotonic() + 10
    while len(got := store.outcomes("learning")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    store.close()
    assert [(o.tenant, o.model, o.cheap_ok, o.answer) for o in got] == [
        ("learner", "cheap", True, None),
        ("learner", "cheap", False, None),
        ("distiller", "cheap", False, "Paris "),  # the distillation opt-in keeps the cheap answer
    ]
    assert got[1].prompt == QUESTION[0]["content"] and got[1].reason.startswith("low confidence")


def test_a_learning_route_retrains_on_a_schedule_and_serves_the_new_router(gw, answers) -> None:
    import time
    from pathlib import Path

    from tokenops.fusion.routers import LogisticRouter, RouteFeatures

    teacher = client_for(gw, "teacher")
    easy = [f"What is the capital of {c}?" for c in ("Spain", "Italy", "Japan", "Egypt", "Peru", "Chile")]
    hard = [
        f"Write a {lang} program that implements a concurrent B-tree with range scans and tests."
        for lang in ("Rust", "Go", "Java", "C++", "Haskell", "Scala")
    ]
    for _ in range(2):
        for e, h in zip(easy, hard, strict=True):
            answers["cheap"].logprob = -0.05  # the cheap answer is kept: a "cheap was enough" label
            teacher.chat.completions.create(model="relearning", messages=[{"role": "user", "content": e}])
            answers["cheap"].logprob = -3.0  # rejected and escalated: a "needed strong" label
            teacher.chat.completions.create(model="relearning", messages=[{"role": "user", "content": h}])
    deadline = time.monotonic() + 60
    swapped = 0.0
    while time.monotonic() < deadline and not swapped:
        swapped = sum(
            float(x.split()[-1])
            for x in httpx.get(gw.url + "/metrics").text.splitlines()
            if x.startswith("tokenops_router_retrains_total{")
            and 'route="relearning"' in x
            and 'result="swapped"' in x
        )
        time.sleep(0.2)
    assert swapped >= 1, "the route was never retrained"
    answers["cheap"].logprob = -0.05
    raw = teacher.chat.completions.with_raw_response.create(
        model="relearning", messages=[{"role": "user", "content": "What is the capital of Kenya?"}]
    )
    assert "reason=learned score" in raw.headers["x-tokenops-route"]  # the retrained router decides
    saved = LogisticRouter.load(Path(gw.settings.routes["relearning"].router_model))
    assert saved.threshold is not None
    hard_score = saved.score(
        [RouteFeatures.of("Write a Kotlin program that implements a B-tree with tests.")]
    )
    easy_score = saved.score([RouteFeatures.of("What is the capital of Norway?")])
    assert hard_score[0] > easy_score[0]
