"""Speculative decoding inside the continuous batch, on a tiny random Llama (and SmolLM2).

Greedy output with prompt lookup and with self-drafts must equal plain decoding token for token,
with staggered arrivals, requests that opt out, stop tokens and max_tokens in one batch, and under
KV-pool pressure that preempts. Rejected drafts' KV slots are rolled back and prefix-cache hashes
cover committed tokens only. Counters: a self-draft of the whole target accepts every draft.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.models import ModelConfig, build_model
from tokenops.engine.sampling_params import SamplingParams
from tokenops.engine.speculative.config import SpeculativeConfig
from tokenops.engine.speculative.draft_length import DraftLength

NGRAM = {"method": "ngram", "num_tokens": 4}
SELF1 = {"method": "draft", "draft_model": "self:1", "num_tokens": 3}
SELF_FULL = {"method": "draft", "draft_model": "self:2", "num_tokens": 4}  # the whole 2-layer target


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    """A tiny Llama whose greedy outputs fall into loops: prompt lookup finds matches in them."""
    return tiny_llama(0)


def tiny_llama(seed: int, layers: int = 2, vocab: int = 256):
    """A random tiny Llama (our model, from transformers' init with a larger range)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    m = build_model(ModelConfig.from_hf_config(hf.config.to_dict()))
    m.load_weights(hf.state_dict().items())
    return m


def engine(model, speculative=None, draft_model=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLMEngine(
        model, EngineConfig(speculative=speculative, **kw), eos_token_ids=[2], draft_model=draft_model
    )


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        motif = torch.randint(3, 256, (max(3, n // 3),), generator=g).tolist()
        out.append((motif * 3)[:n])  # repeated text, as in an edit of a given paragraph
    return out


def run_staggered(eng: LLMEngine, requests: list[tuple[int, list[int], SamplingParams]]) -> list[list[int]]:
    """`requests[i] = (arrival step, prompt, params)`; returns each request's output ids."""
    out: dict[str, list[int]] = {}
    step = 0
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    while pending or eng.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            eng.add_request(f"r{i}", prompt, params)
            out[f"r{i}"] = []
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
            check_kv_accounting(eng)
        step += 1
    assert_drained(eng)
    return [out[f"r{i}"] for i in range(len(requests))]


def check_kv_accounting(eng: LLMEngine) -> None:
    """Rejected drafts hold no blocks, and prefix-cache hashes cover committed tokens only."""
    bs = eng.pool.block_size
    for seq in eng.scheduler.running:
        assert len(seq.block_table) <= math.ceil(len(seq.token_ids) / bs)
        assert seq.num_computed_tokens <= len(seq.token_ids)
        assert len(seq.block_hashes) <= seq.num_computed_tokens // bs
        for i, _ in enumerate(seq.block_hashes):
            block = eng.pool.blocks[seq.block_table[i]]
            if block.token_ids is not None:
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
    eng.pool.check_invariants()


def assert_drained(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.pool.check_invariants()


def mixed_requests(plain_out: list[list[int]] | None = None) -> list[tuple[int, list[int], SamplingParams]]:
    ps = prompts(9, 17, 5, 30, 12, 21)
    greedy = dict(temperature=0, ignore_eos=True)
    reqs = [
        (0, ps[0], SamplingParams(max_tokens=24, **greedy)),
        (0, ps[1], SamplingParams(max_tokens=1, **greedy)),
        (2, ps[2], SamplingParams(max_tokens=30, **greedy)),
        (3, ps[3], SamplingParams(max_tokens=17, speculative=False, **greedy)),  # opted out
        (5, ps[4], SamplingParams(max_tokens=2, **greedy)),
        (6, ps[5], SamplingParams(max_tokens=28, **greedy)),
    ]
    if plain_out is not None:
        # a stop token taken from the middle of a plain output: speculation must stop at it too
        stop = plain_out[5][12]
        reqs.append((7, ps[5], SamplingParams(max_tokens=28, temperature=0, stop_token_ids=[stop])))
    return reqs


@pytest.mark.parametrize("spec", [NGRAM, SELF1, SELF_FULL], ids=["ngram", "self1", "self-full"])
def test_greedy_output_equals_plain_decoding(model, spec) -> None:
    plain = run_staggered(engine(model), mixed_requests())
    reqs = mixed_requests(plain)
    plain = run_staggered(engine(model), reqs)
    eng = engine(model, spec)
    assert run_staggered(eng, reqs) == plain
    stop_out = plain[-1]
    assert stop_out[-1] == reqs[-1][2].stop_token_ids[0] and len(stop_out) < 28
    assert eng.stats.spec_draft_tokens > 0 and eng.stats.spec_accepted_tokens > 0
    assert eng.stats.generation_tokens == sum(len(o) for o in plain)


def test_small_batch_budget_and_chunked_prefill(model) -> None:
    """Drafts only take budget left after the step's known tokens; prefill chunks still interleave."""
    reqs = [
        (i, p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts(30, 11, 25, 8, seed=3))
    ]
    plain = run_staggered(engine(model, max_num_batched_tokens=7), reqs)
    assert run_staggered(engine(model, NGRAM, max_num_batched_tokens=7), reqs) == plain


def test_preemption_under_kv_pressure_keeps_output(model) -> None:
    reqs = [
        (0, p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for p in prompts(14, 18, 11, 16, seed=5)
    ]
    plain = run_staggered(engine(model, num_kv_blocks=24), reqs)
    for spec in (NGRAM, SELF_FULL):
        eng = engine(model, spec, num_kv_blocks=24)
        assert run_staggered(eng, reqs) == plain
        assert eng.stats.preemptions > 0
        assert eng.stats.spec_accepted_tokens > 0


def test_whole_target_as_draft_accepts_everything_and_counts(model) -> None:
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    plain_eng = engine(model)
    plain = plain_eng.generate(prompts(10, 13), params)
    eng = engine(model, SELF_FULL)
    assert eng.generate(prompts(10, 13), params) == plain
    s = eng.stats
    # the first token comes from prefill; then each step drafts min(4, tokens left - 1), all accepted:
    # 20 more tokens per request = 4 steps of 4 drafts + 1, so 16 drafts and 4 verifications each
    assert (s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications) == (32, 32, 8)
    assert s.spec_acceptance_rate == 1.0 and s.spec_mean_accepted_length == 5.0
    assert s.generation_tokens == 42
    assert s.steps < plain_eng.stats.steps
    load = eng.load().to_dict()
    assert load["spec_draft_tokens"] == 32 and load["spec_acceptance_rate"] == 1.0


def test_committed_blocks_serve_a_later_prefix_hit(model) -> None:
    """Blocks indexed while speculating hold exactly the committed tokens: a request that extends
    the finished sequence hits them and continues exactly as plain decoding does."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = prompts(11, seed=9)[0]
    eng = engine(model, SELF1)
    out = eng.generate([prompt], params)[0]
    follow = prompt + out
    assert eng.pool.lookup(follow) >= 32
    cont = eng.generate([follow], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert cont == engine(model).generate(
        [follow], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )


def test_opted_out_and_logprob_requests_decode_plainly(model) -> None:
    eng = engine(model, NGRAM)
    p = prompts(12, seed=2)[0]
    out = eng.generate([p], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative=False))[
        0
    ]
    assert eng.stats.spec_draft_tokens == 0
    eng.add_request("lp", p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
    got, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            got.extend(o.new_token_ids)
            lps.extend(o.logprobs or [])
    assert eng.stats.spec_draft_tokens == 0
    assert got == out and [lp.token_id for lp in lps] == got


def test_seeded_sampling_with_speculation_is_reproducible(model) -> None:
    p = prompts(15, seed=4)[0]
    params = SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    for spec in (NGRAM, SELF1):
        a = engine(model, spec).generate([p], params)
        b = engine(model, spec).generate([p, prompts(7, seed=8)[0]], [params, params])[0:1]
        assert a == b and len(a[0]) == 25


def test_draft_length_adapts_to_acceptance() -> None:
    cfg = SpeculativeConfig("ngram", num_tokens=6, ewma_weight=0.5, min_acceptance=0.2, cooldown_steps=3)
    d = DraftLength(cfg)
    assert d.next() == 6
    d.observe(6, 3)  # rate 0.5 -> ewma 0.75
    assert d.next() == 5
    d.observe(5, 0)  # 0.375
    d.observe(3, 0)  # 0.1875 < 0.2: plain decoding for 3 steps, then a one-token probe
    assert [d.next() for _ in range(4)] == [0, 0, 0, 1]
    d.observe(1, 0)  # rejected probe: the cooldown doubles
    assert [d.next() for _ in range(7)] == [0] * 6 + [1]
    d.observe(1, 1)  # accepted probe: speculate again
    assert d.next() == 3
    fixed = DraftLength(SpeculativeConfig("ngram", num_tokens=4, adaptive=False))
    fixed.observe(4, 0)
    assert fixed.next() == 4


def test_config_is_validated() -> None:
    assert EngineConfig(speculative="ngram").speculative == SpeculativeConfig("ngram")
    assert (
        EngineConfig(speculative='{"method": "draft", "draft_model": "self:3"}').speculative.draft_layers == 3
    )
    for bad in (
        "medusa",
        {"method": "draft"},
        {"method": "draft", "draft_model": "self:x"},
        {"method": "ngram", "num_tokens": 0},
        {"method": "ngram", "k": 3},
        "[1]",
    ):
        with pytest.raises(ValueError):
            EngineConfig(speculative=bad)


EXTERNAL = {"method": "draft", "draft_model": "a-separate-model", "num_tokens": 4}


def test_separate_draft_model_keeps_its_own_cache_in_step(model) -> None:
    """A separate copy of the target as the draft: its own KV cache, kept in step by mirroring every
    batch, must make every greedy draft accepted, through staggered arrivals and preemption."""
    reqs = mixed_requests()
    plain = run_staggered(engine(model), reqs)
    eng = engine(model, EXTERNAL, draft_model=tiny_llama(0))
    assert run_staggered(eng, reqs) == plain
    assert eng.stats.spec_draft_tokens > 0 and eng.stats.spec_acceptance_rate == 1.0
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    pressured = [(0, p, params) for p in prompts(14, 18, 11, 16, seed=5)]
    eng = engine(model, EXTERNAL, draft_model=tiny_llama(0), num_kv_blocks=24)
    assert run_staggered(eng, pressured) == run_staggered(engine(model, num_kv_blocks=24), pressured)
    assert eng.stats.preemptions > 0 and eng.stats.spec_acceptance_rate == 1.0


def test_a_different_small_draft_model_gives_identical_greedy_output(model) -> None:
    reqs = mixed_requests()
    eng = engine(model, EXTERNAL, draft_model=tiny_llama(7, layers=1))
    assert run_staggered(eng, reqs) == run_staggered(engine(model), reqs)
    assert eng.stats.spec_draft_tokens > 0


def test_draft_model_with_another_vocabulary_is_refused(model) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        engine(model, EXTERNAL, draft_model=tiny_llama(1, vocab=128))


def test_self_draft_larger_than_target_is_refused(model) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        engine(model, {"method": "draft", "draft_model": "self:3"})


@pytest.mark.bundled
def test_bundled_smollm2_prompt_lookup_copies_faster_with_identical_output(bundled_model) -> None:
    loaded = bundled_model("smollm2-135m-instruct")
    tok = loaded.tokenizer
    text = (
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the quiet "
        "river bank at dawn."
    )
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    params = SamplingParams(max_tokens=24, temperature=0)
    cfg = dict(num_kv_blocks=64, num_threads=1)
    plain_eng = LLMEngine.from_loaded(loaded, EngineConfig(**cfg))
    plain = plain_eng.generate([ids], params)
    eng = LLMEngine.from_loaded(loaded, EngineConfig(speculative=NGRAM, **cfg))
    assert eng.generate([ids], params) == plain
    assert eng.stats.spec_acceptance_rate > 0.5
    assert eng.stats.steps < plain_eng.stats.steps


def test_engine_command_refuses_bad_speculative_flags() -> None:
    from typer.testing import CliRunner

    from tokenops.cli import app

    runner = CliRunner()
    for args, needle in (
        (["--speculative", "medusa"], "unknown speculative method"),
        (["--speculative", "draft"], "needs draft_model"),
        (["--speculative", "draft", "--speculative-draft", "self:0"], "self:N"),
        (["--num-speculative-tokens", "3"], "need --speculative"),
    ):
        result = runner.invoke(app, ["engine", *args])
        assert result.exit_code == 2, result.output
        assert needle in " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # rich's error box


def test_separate_draft_model_with_an_int8_kv_cache(model) -> None:
    """The draft's own cache takes the target's KV layout, int8 (quantised) included."""
    reqs = mixed_requests()
    eng = engine(model, EXTERNAL, draft_model=tiny_llama(7, layers=1), kv_cache_dtype="int8")
    assert run_staggered(eng, reqs) == run_staggered(engine(model, kv_cache_dtype="int8"), reqs)
    assert eng.stats.spec_draft_tokens > 0
