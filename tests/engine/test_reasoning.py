"""Reasoning budgets in the engine: the marker parser, the forced-token hook, and the engine loop on
the tiny thinking Llama (tests/conftest.py), whose bias keeps it from ever closing its thinking."""

from __future__ import annotations

import pytest

from tokenops.engine.config import EngineConfig, RequestRejected
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.reasoning import (
    DEFAULT_EFFORT_BUDGETS,
    Phase,
    ReasoningBudget,
    ReasoningMarkers,
    ReasoningParser,
    ReasoningSpec,
    detect_markers,
    generation_suffix,
    parse_effort_budgets,
    prompt_phase,
    resolve_budget,
)
from tokenops.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

ONE = ReasoningMarkers((90,), (91,), "<think>", "</think>")
MULTI = ReasoningMarkers((80, 81), (82, 82, 83), "<r>", "</r>")  # the end marker repeats its first token


# --- the parser -------------------------------------------------------------------------------------


def test_parser_splits_single_token_markers():
    p = ReasoningParser(ONE, Phase.BEFORE)
    assert p.split([90, 5, 6, 91, 7, 90, 8]) == (
        [5, 6],
        [7, 90, 8],
    )  # a second <think> in the answer is content
    assert p.reasoning_tokens == 2 and p.closed and p.phase is Phase.ANSWER


def test_parser_without_a_start_marker_is_all_content():
    p = ReasoningParser(ONE, Phase.BEFORE)
    assert p.split([5, 91, 6]) == ([], [5, 91, 6])
    assert p.reasoning_tokens == 0 and not p.closed


def test_parser_holds_a_possible_multi_token_marker_until_decided():
    p = ReasoningParser(MULTI, Phase.THINKING)
    assert p.feed(1) == ([1], [])
    assert p.feed(82) == ([], [])  # may start </r>
    assert p.feed(82) == ([], [])
    assert p.feed(82) == ([82], [])  # 82 82 82: the first cannot be part of the marker any more
    assert p.section_tokens == 4
    assert p.feed(83) == ([], [])  # 82 82 83: closed
    assert p.phase is Phase.ANSWER and p.reasoning_tokens == 2
    assert p.feed(82) == ([], [82])


def test_parser_flush_gives_held_tokens_to_their_part():
    p = ReasoningParser(MULTI, Phase.THINKING)
    p.split([1, 82, 82])
    assert p.flush() == ([82, 82], [])
    assert p.reasoning_tokens == 3
    q = ReasoningParser(MULTI, Phase.BEFORE)
    assert q.feed(80) == ([], [])
    assert q.flush() == ([], [80])


def test_parser_open_start_marker_that_fails_is_content():
    p = ReasoningParser(MULTI, Phase.BEFORE)
    assert p.split([80, 5]) == ([], [80, 5])


@pytest.mark.parametrize(
    ("suffix", "phase"),
    [
        ("<|im_start|>assistant\n", Phase.BEFORE),
        ("<|im_start|>assistant\n<think>\n", Phase.THINKING),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.ANSWER),
    ],
)
def test_prompt_phase(suffix, phase):
    assert prompt_phase(suffix, ONE) is phase


def test_prompt_phase_start_inside_end_marker():
    nested = ReasoningMarkers((1,), (2,), "think", "/think")
    assert prompt_phase("a think b /think c", nested) is Phase.ANSWER


def test_generation_suffix():
    assert generation_suffix("<u>hi</u><a><think>\n", "<u>hi</u>") == "<a><think>\n"


# --- the budget hook --------------------------------------------------------------------------------


def run_budget(spec: ReasoningSpec, sampled: list[int]) -> list[int]:
    budget = ReasoningBudget(spec)
    return [budget.next_token(t, None)[0] for t in sampled]


def test_budget_forces_the_end_marker_after_exactly_n_tokens():
    out = run_budget(ReasoningSpec(ONE, Phase.THINKING, 3), [5, 6, 7, 8, 9, 10])
    assert out == [5, 6, 7, 91, 9, 10]


def test_budget_counts_from_the_models_own_start_marker():
    out = run_budget(ReasoningSpec(ONE, Phase.BEFORE, 2), [90, 5, 6, 7, 8])
    assert out == [90, 5, 6, 91, 8]


def test_budget_zero_inside_a_section_closes_it_at_once():
    assert run_budget(ReasoningSpec(ONE, Phase.THINKING, 0), [5, 6]) == [91, 6]


def test_budget_that_the_model_stays_under_changes_nothing():
    sampled = [5, 6, 91, 7, 8, 9, 10]
    assert run_budget(ReasoningSpec(ONE, Phase.THINKING, 4), sampled) == sampled


def test_budget_forces_the_whole_multi_token_marker_over_a_partial_one():
    # the model had started what could be </r> when the budget ran out: the full marker still follows
    out = run_budget(ReasoningSpec(MULTI, Phase.THINKING, 3), [1, 2, 82, 4, 4, 4, 4])
    assert out == [1, 2, 82, 82, 82, 83, 4]
    p = ReasoningParser(MULTI, Phase.THINKING)
    p.split(out)
    assert p.reasoning_tokens == 3 and p.closed


def test_forced_token_reports_a_certain_logprob():
    from tokenops.engine.sequence import TokenLogprob

    budget = ReasoningBudget(ReasoningSpec(ONE, Phase.THINKING, 0))
    token, lp = budget.next_token(5, TokenLogprob(5, -1.5, [(5, -1.5), (91, -3.0)]))
    assert token == 91 and lp.token_id == 91 and lp.logprob == 0.0 and lp.top == [(5, -1.5), (91, -3.0)]


# --- budgets from a request ---------------------------------------------------------------------------


def test_resolve_budget_takes_the_smaller_of_both():
    assert resolve_budget(None, None, DEFAULT_EFFORT_BUDGETS) is None
    assert resolve_budget(100, None, DEFAULT_EFFORT_BUDGETS) == 100
    assert resolve_budget(None, "low", DEFAULT_EFFORT_BUDGETS) == 1024
    assert resolve_budget(5000, "low", DEFAULT_EFFORT_BUDGETS) == 1024
    assert resolve_budget(10, "high", DEFAULT_EFFORT_BUDGETS) == 10
    assert resolve_budget(None, "high", {"high": None}) is None


def test_resolve_budget_refuses_unknown_effort_and_negative_budget():
    with pytest.raises(RequestRejected) as e:
        resolve_budget(None, "extreme", DEFAULT_EFFORT_BUDGETS)
    assert e.value.param == "reasoning_effort" and "low" in e.value.message
    with pytest.raises(RequestRejected):
        resolve_budget(-1, None, DEFAULT_EFFORT_BUDGETS)


def test_parse_effort_budgets():
    b = parse_effort_budgets(["low=64", "high=none", "turbo=7"])
    assert b["low"] == 64 and b["high"] is None and b["turbo"] == 7 and b["medium"] == 8192
    with pytest.raises(ValueError):
        parse_effort_budgets(["low"])
    with pytest.raises(ValueError):
        parse_effort_budgets(["low=-3"])


# --- markers from a real tokenizer ----------------------------------------------------------------------


def test_markers_detected_from_tokenizer_and_template(thinker):
    tok = thinker("r1").tokenizer
    m = detect_markers(tok)
    assert m == ReasoningMarkers((256,), (257,), "<think>", "</think>")
    assert ReasoningMarkers.parse(tok, "none") is None
    multi = ReasoningMarkers.parse(tok, "<reason>,</reason>")
    assert multi.end == tuple(tok.encode("</reason>", add_special_tokens=False)) and len(multi.end) == 9


def test_markers_not_detected_without_template_mention(thinker):
    tok = thinker("r1").tokenizer
    tok_plain = type(tok)(tok.backend, bos_token_id=None, eos_token_ids=[2], chat_template="{{ messages }}")
    assert detect_markers(tok_plain) is None


# --- the engine loop ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker_engine(thinker):
    loaded = thinker("r1")
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)
    )
    tok = loaded.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "why is the sky blue?"}]),
        add_special_tokens=False,
    )
    return engine, tok, prompt, detect_markers(tok)


def test_engine_budget_n_gives_n_reasoning_tokens_then_the_end_marker(thinker_engine):
    engine, _, prompt, markers = thinker_engine
    free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert 257 not in free  # the biased model never closes its thinking itself
    for n in (0, 1, 7, 20):
        spec = ReasoningSpec(markers, Phase.THINKING, n)
        out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0, reasoning=spec))[0]
        assert out[:n] == free[:n]  # the thinking is the model's own, token for token
        assert out[n] == 257
        assert 257 not in out[n + 1 :] and len(out) == 30
        parser = ReasoningParser(markers, Phase.THINKING)
        parser.split(out)
        assert parser.reasoning_tokens == n


def test_engine_without_budget_or_with_an_unreached_one_is_unchanged(thinker_engine):
    engine, _, prompt, markers = thinker_engine
    for params in (dict(temperature=0), dict(temperature=0.9, seed=11)):
        plain = engine.generate([prompt], SamplingParams(max_tokens=24, **params))[0]
        roomy = ReasoningSpec(markers, Phase.THINKING, 1000)
        assert engine.generate([prompt], SamplingParams(max_tokens=24, reasoning=roomy, **params))[0] == plain


def test_engine_forces_a_multi_token_marker_in_a_batch(thinker_engine):
    engine, tok, prompt, _ = thinker_engine
    multi = ReasoningMarkers.from_strings(tok, "<reason>", "</reason>")
    spec = ReasoningSpec(multi, Phase.THINKING, 5)
    outs = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=20, temperature=0, reasoning=spec),
            SamplingParams(max_tokens=20, temperature=0),
        ],
    )
    assert list(outs[0][5 : 5 + len(multi.end)]) == list(multi.end)
    assert outs[0][:5] == outs[1][:5]
    assert tok.decode(outs[0][5:14]) == "</reason>"


def test_engine_budget_counts_against_max_tokens(thinker_engine):
    engine, _, prompt, markers = thinker_engine
    spec = ReasoningSpec(markers, Phase.THINKING, 4)
    out = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, reasoning=spec))[0]
    assert len(out) == 5 and out[4] == 257


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_budget_inside_an_accepted_speculative_run_cuts_the_run_there(thinker, thinker_engine, method):
    plain_engine, _, prompt, markers = thinker_engine
    loaded = thinker("r1")
    # a self-draft of every layer proposes exactly what the target will accept: k tokens per step,
    # so the budget runs out in the middle of an accepted run
    draft = {"method": "draft", "draft_model": f"self:{loaded.model.config.num_layers}", "num_tokens": 4}
    speculative = draft if method == "draft" else {"method": "ngram", "num_tokens": 4}
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64, speculative=speculative),
    )
    for n in (0, 1, 6, 13):

        def params(budget: int) -> SamplingParams:  # a fresh budget state per request
            return SamplingParams(
                max_tokens=30, temperature=0, reasoning=ReasoningSpec(markers, Phase.THINKING, budget)
            )

        expected = plain_engine.generate([prompt], params(n))[0]
        assert engine.generate([prompt], params(n))[0] == expected
        assert expected[n] == 257
    if method == "draft":
        assert engine.stats.spec_accepted_tokens > 0
