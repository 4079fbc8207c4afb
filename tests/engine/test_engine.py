"""LLMEngine end to end on tiny random Llama / Gemma 3 models, checked against transformers.

Greedy tokens must equal HF `generate` token for token whatever the batching: requests arriving
mid-run, mixed batches, chunked prefill of any chunk size, prefix-cache hits, preemption under a
tiny KV pool. Also: seeded sampling independent of the batch, abort, rejection, load and events.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.config import ContextLengthExceeded, EngineConfig, RequestRejected
from tokenops.engine.kv_cache import kv_bytes_per_block
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.models import ModelConfig, build_model
from tokenops.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the test machine is shared, and two OpenMP threads that wait on each
    other while descheduled make every op several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Oracle:
    """Our model plus HF greedy references, memoised per prompt."""

    def __init__(self, hf, model):
        self.hf, self.model, self._refs = hf, model, {}

    def ref(self, prompt: list[int], n: int = 12) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._refs:
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=n,
                    eos_token_id=None,
                    do_sample=False,
                    pad_token_id=0,
                )
            self._refs[key] = out[0, len(prompt) :].tolist()
        return self._refs[key]

    def engine(self, **kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 128)
        kw.setdefault("block_size", 4)
        return LLMEngine(self.model, EngineConfig(**kw), eos_token_ids=[2])


@pytest.fixture(scope="module")
def llama() -> Oracle:
    """A tiny Llama with a larger init than HF's default, so greedy outputs vary (not one repeated id)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
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
    model = build_model(ModelConfig.from_hf_config(hf.config.to_dict()))
    model.load_weights(hf.state_dict().items())
    return Oracle(hf, model)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def drain(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.pool.blocks)
    engine.pool.check_invariants()


def test_greedy_equals_transformers(llama):
    ps = prompts(1, 5, 11, 17, 30)
    engine = llama.engine()
    assert engine.generate(ps, GREEDY) == [llama.ref(p) for p in ps]
    drain(engine)


def test_requests_arriving_mid_run(llama):
    ps = prompts(6, 13, 9, 21, seed=1)
    engine = llama.engine(max_num_batched_tokens=16)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    engine.add_request("0", ps[0], GREEDY)
    arrivals = {2: 1, 3: 2, 7: 3}  # step number -> request index
    step = 0
    while engine.has_unfinished() or arrivals:
        if step in arrivals:
            i = arrivals.pop(step)
            engine.add_request(str(i), ps[i], GREEDY)
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        step += 1
    assert [got[str(i)] for i in range(len(ps))] == [llama.ref(p) for p in ps]
    drain(engine)


def test_alone_equals_inside_a_mixed_batch(llama):
    target, *others = prompts(14, 3, 25, 8, seed=2)
    alone = llama.engine().generate([target], GREEDY)[0]
    mixed = llama.engine().generate(
        [others[0], target, *others[1:]],
        [
            SamplingParams(max_tokens=5, temperature=0.8, seed=3),
            GREEDY,
            GREEDY,
            SamplingParams(max_tokens=20, temperature=1.0, top_k=5),
        ],
    )
    assert mixed[1] == alone == llama.ref(target)


@pytest.mark.parametrize("budget", [1, 7, 4])  # 4 = one block
def test_chunked_prefill_equals_one_shot(llama, budget):
    ps = prompts(19, 10, seed=3)
    one_shot = llama.engine(max_num_batched_tokens=512).generate(ps, GREEDY)
    engine = llama.engine(max_num_batched_tokens=budget)
    assert engine.generate(ps, GREEDY) == one_shot == [llama.ref(p) for p in ps]
    drain(engine)


def test_prefix_cache_hit_equals_miss_and_is_reported(llama):
    (shared,) = prompts(16, seed=4)
    a, b = shared + [7, 8, 9], shared + [10, 11]
    engine = llama.engine()
    assert engine.generate([a], GREEDY) == [llama.ref(a)]
    engine.add_request("b", b, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    assert tokens == llama.ref(b)
    assert cached == 16  # four full blocks of the shared prefix
    snap = engine.load()
    assert snap.prefix_cache_hits == 16 and snap.prefix_cache_queries == len(a) + len(b)
    drain(engine)


def test_fully_cached_prompt_computes_its_last_token(llama):
    (p,) = prompts(12, seed=5)  # exactly three blocks
    engine = llama.engine()
    first = engine.generate([p], GREEDY)
    engine.add_request("again", p, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == first[0] == llama.ref(p)
    assert outs[-1].num_cached_tokens == 8  # the last block is recomputed for its last token's logits


def test_preemption_under_tiny_pool_equals_unconstrained(llama):
    ps = prompts(9, 14, 7, 11, seed=6)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    free = llama.engine().generate(ps, params)
    engine = llama.engine(num_kv_blocks=12, block_size=4)  # 48 slots for ~105 tokens of demand
    tight = engine.generate(ps, params)
    assert engine.stats.preemptions > 0
    assert tight == free
    drain(engine)


def test_preemption_with_prefix_caching_off(llama):
    ps = prompts(9, 14, 7, seed=7)
    free = llama.engine().generate(ps, GREEDY)
    engine = llama.engine(num_kv_blocks=10, enable_prefix_caching=False)
    assert engine.generate(ps, GREEDY) == free
    assert engine.stats.preemptions > 0
    drain(engine)


def test_abort_frees_blocks_and_reports(llama):
    ps = prompts(10, 10, seed=8)
    engine = llama.engine(enable_prefix_caching=False)
    engine.add_request("a", ps[0], SamplingParams(max_tokens=100, ignore_eos=True, temperature=0))
    engine.add_request("b", ps[1], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.abort("a")
    engine.abort("nope")  # unknown ids are ignored
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert [o.finish_reason for o in outs if o.finished and o.request_id == "b"] == ["length"]
    drain(engine)


def test_seeded_sampling_reproducible_across_batches(llama):
    target, *others = prompts(9, 4, 17, seed=9)
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llama.engine().generate([target], params)[0]
    noise = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    crowd = llama.engine(max_num_batched_tokens=8).generate(
        [others[0], target, others[1]], [noise, params, noise]
    )
    assert crowd[1] == alone
    other_seed = llama.engine().generate([target], SamplingParams(max_tokens=15, temperature=1.0, seed=7))[0]
    assert other_seed != alone


def test_stop_tokens_and_eos(llama):
    (p,) = prompts(8, seed=10)
    ref = llama.ref(p)
    stop_at = ref[3]
    out = llama.engine().generate(
        [p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at], ignore_eos=True)
    )[0]
    assert out == ref[: ref.index(stop_at) + 1]
    engine = LLMEngine(llama.model, EngineConfig(num_kv_blocks=64, block_size=4), eos_token_ids=[ref[2]])
    assert (
        engine.generate([p], SamplingParams(max_tokens=12, temperature=0))[0] == ref[: ref.index(ref[2]) + 1]
    )


def test_logprobs_in_outputs(llama):
    (p,) = prompts(6, seed=11)
    engine = llama.engine()
    engine.add_request("r", p, SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 3
    for o in outs:
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] and len(lp.top) == 2
        assert lp.top[0][0] == lp.token_id and abs(lp.top[0][1] - lp.logprob) < 1e-6  # greedy = top-1


def test_rejections(llama):
    engine = llama.engine(num_kv_blocks=8, block_size=4, max_model_len=100)
    assert engine.max_model_len == 32  # capped by the pool
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("long", [5] * 32, GREEDY)
    with pytest.raises(RequestRejected):
        engine.add_request("oov", [5, 256], GREEDY)
    with pytest.raises(RequestRejected):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestRejected):
        SamplingParams(temperature=-1)
    engine.add_request("ok", [5] * 31, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    with pytest.raises(RequestRejected):
        engine.add_request("ok", [5], GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and len(outs) == 1  # one token fits the window


def test_load_snapshot_and_kv_events(llama):
    engine = llama.engine(max_num_seqs=1)
    for i, p in enumerate(prompts(9, 9, seed=12)):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    snap = engine.load()
    assert (snap.running, snap.waiting, snap.kv_blocks_total) == (1, 1, 128)
    assert snap.kv_blocks_used == 3 and snap.tokens_in_flight == 9 + 1 + 9
    events = engine.drain_kv_events()
    assert [e.kind for e in events] == ["stored", "stored"]
    assert snap.to_dict()["kv_usage"] == pytest.approx(3 / 128)


def test_pool_sized_from_memory_budget(llama):
    per_block = kv_bytes_per_block(llama.model.config, 4, torch.float32)
    engine = LLMEngine(llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=per_block * 37))
    assert engine.pool.num_blocks == 37


def _built_derived_bytes(model) -> int:
    from tokenops.engine.models.layers import _DerivedWeight

    copies = [
        v
        for m in [*model.modules(), model.vocab_projection]
        for v in vars(m).values()
        if isinstance(v, _DerivedWeight) and v.value is not None
    ]
    return sum(c.value.numel() * c.value.element_size() for c in copies)


def test_memory_accounting_counts_derived_weight_copies_before_they_are_built(llama):
    from tokenops.engine.models.layers import onednn_linear_available

    per_block = kv_bytes_per_block(llama.model.config, 4, torch.float32)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = LLMEngine(llama.model, EngineConfig(block_size=4, kv_cache_memory_bytes=per_block * 37))
    counted = engine.memory_bytes
    assert counted["kv_cache"] == per_block * 37
    assert counted["weights"] == sum(p.numel() * 4 for p in llama.model.parameters())
    # one decode row (transposed head) and two (prepacked layers and head) build every copy
    engine.generate([[5, 6, 7]], params)
    engine.generate([[5, 6, 7], [8, 9]], params)
    assert counted["derived_weights"] == _built_derived_bytes(llama.model) > 0
    if onednn_linear_available():  # every layer weight once, the tied head twice
        layers = sum(p.numel() * 4 for n, p in llama.model.named_parameters() if n.endswith("proj.weight"))
        assert counted["derived_weights"] == layers + 2 * llama.model.model.embed_tokens.weight.numel() * 4
    off = LLMEngine(llama.model, EngineConfig(block_size=4, num_kv_blocks=8, derived_weights=False))
    assert off.memory_bytes["derived_weights"] == 0 == _built_derived_bytes(llama.model)
    LLMEngine(llama.model, EngineConfig(block_size=4, num_kv_blocks=8))  # switched back on for later tests


def test_gemma3_sliding_window_greedy_and_chunked(tiny_gemma3):
    ps = prompts(20, 7, seed=13)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    refs = []
    for p in ps:
        out = tiny_gemma3.hf.generate(
            torch.tensor([p]), max_new_tokens=10, eos_token_id=None, do_sample=False, pad_token_id=0
        )
        refs.append(out[0, len(p) :].tolist())
    for budget in (512, 3):
        engine = LLMEngine(
            tiny_gemma3.model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=budget)
        )
        assert engine.generate(ps, params) == refs
