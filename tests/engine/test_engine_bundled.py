"""The engine on the bundled SmolLM2-135M-Instruct: greedy tokens equal transformers' `generate` on
the same weights, in a batch with staggered arrivals and chunked prefill, and a prefix-cache hit
changes nothing but the cached-token count.

The reference is transformers' own `LlamaForCausalLM` holding the weights our loader read from the
GGUF file (fused projections split back into HF names): this checks the engine (paging, batching,
scheduling), while the loader's GGUF reading is checked against transformers' GGUF conversion in
the models' own tests.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.bundled

NAME = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
N = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the test machine is shared, and two OpenMP threads that wait on each
    other while descheduled make every op several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_twin(ours):
    """transformers' Llama with our loaded weights."""
    transformers = pytest.importorskip("transformers")
    c = ours.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=0,
    )
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {}
    for name, t in ours.model.state_dict().items():
        if ".qkv_proj." in name:
            for part, w in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]), strict=True):
                state[name.replace("qkv_proj", part)] = w
        elif ".gate_up_proj." in name:
            for part, w in zip(("gate_proj", "up_proj"), t.split(c.intermediate_size), strict=True):
                state[name.replace("gate_up_proj", part)] = w
        else:
            state[name] = t
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return hf


@pytest.fixture(scope="module")
def smol(bundled_model):
    ours = bundled_model(NAME)
    hf = hf_twin(ours)
    tok = ours.tokenizer
    ps = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    refs = []
    for p in ps:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, eos_token_id=None)
        refs.append(out[0, len(p) :].tolist())
    return ours, ps, refs


def test_greedy_equals_transformers_with_staggered_arrivals(smol):
    ours, ps, refs = smol
    engine = LLMEngine.from_loaded(ours, EngineConfig(max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    got = {str(i): [] for i in range(len(ps))}
    engine.add_request("0", ps[0], params)
    step = 0
    while engine.has_unfinished() or step < 4:
        if step in (1, 3):
            i = 1 if step == 1 else 2
            engine.add_request(str(i), ps[i], params)
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        step += 1
    assert [got[str(i)] for i in range(len(ps))] == refs


def test_prefix_cache_hit_on_the_chat_prefix(smol):
    ours, ps, refs = smol
    engine = LLMEngine.from_loaded(ours, EngineConfig())
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    assert engine.generate([ps[0]], params) == [refs[0]]
    engine.add_request("again", ps[0], params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == refs[0]
    assert outs[-1].num_cached_tokens == (len(ps[0]) - 1) // 16 * 16 > 0
