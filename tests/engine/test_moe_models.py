"""Oracle tests of the MoE families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE):
logits equal transformers' on tiny random configs, greedy generation through `LLMEngine` equals
HF `generate` token for token, a `save_pretrained` folder (per-expert tensors on disk) loads through
the normal loader, and the block's grouped execution equals a per-token loop over the experts.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.config import EngineConfig
from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.models import ModelConfig, build_model
from tokenops.engine.models.moe import Experts, expert_load, moe_blocks, run_experts_grouped
from tokenops.engine.sampling_params import SamplingParams

TOL = dict(rtol=1e-4, atol=1e-4)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny(request: pytest.FixtureRequest, make_tiny_moe):
    return make_tiny_moe(request.param, seed=MOE_FAMILIES.index(request.param))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(model, lens: list[int], ids: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, 64, block_size, c.num_kv_heads, c.head_dim, torch.float32)
    tables, nxt = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    ctx = build_context(lens, lens, tables, block_size, caches)
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx))


def test_config_reads_the_expert_shape(tiny) -> None:
    moe = tiny.config.moe
    assert tiny.config.architecture == tiny.family
    expected = {
        "mixtral": (6, 2, 48, True, (True, True), 0),
        "qwen2_moe": (8, 3, 32, False, (True, False), 80),
        "qwen3_moe": (8, 2, 32, True, (True, True), 0),
        "olmoe": (8, 4, 32, False, (True, True), 0),
    }[tiny.family]
    assert (
        moe.num_experts,
        moe.top_k,
        moe.expert_intermediate_size,
        moe.norm_topk_prob,
        moe.sparse_layers,
        moe.shared_expert_intermediate_size,
    ) == expected


def test_prompt_logits_match_hf(tiny) -> None:
    ids = _prompt(29)
    torch.testing.assert_close(_logits(tiny.model, [29], torch.tensor(ids)), tiny.hf_logits(ids), **TOL)


def test_ragged_batch_matches_each_prompt_alone(tiny) -> None:
    prompts = [_prompt(n, seed=n) for n in (5, 1, 17)]
    logits = _logits(tiny.model, [len(p) for p in prompts], torch.tensor([t for p in prompts for t in p]))
    start = 0
    for p in prompts:
        torch.testing.assert_close(logits[start : start + len(p)], tiny.hf_logits(p), **TOL)
        start += len(p)


def test_greedy_generation_through_the_engine_equals_hf(tiny) -> None:
    prompts = [_prompt(7, seed=11), _prompt(12, seed=12), _prompt(3, seed=13)]
    engine = LLMEngine(tiny.model, EngineConfig(num_kv_blocks=64, block_size=4), eos_token_ids=[2])
    assert engine.generate(prompts, GREEDY) == [tiny.hf_greedy(p, GREEDY.max_tokens) for p in prompts]


def test_engine_counts_tokens_per_expert(tiny) -> None:
    before = {k: sum(v) for k, v in expert_load(tiny.model).items()}
    engine = LLMEngine(tiny.model, EngineConfig(num_kv_blocks=64, block_size=4), eos_token_ids=[2])
    engine.generate([_prompt(6, seed=3)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    after = expert_load(tiny.model)
    sparse = [str(i) for i, s in enumerate(tiny.config.moe.sparse_layers) if s]
    assert sorted(after) == sparse
    # 6 prompt tokens and 3 decode steps (the 4th token is sampled from the last), top_k slots each;
    # the last layer's experts see only the prompt's sampling row (CausalLM.forward's `rows`)
    last = str(tiny.config.num_layers - 1)
    for layer in sparse:
        tokens = 1 + 3 if layer == last else 6 + 3
        assert sum(after[layer]) - before[layer] == tokens * tiny.config.moe.top_k
    snapshot = engine.load().expert_tokens
    assert snapshot == {layer: after[layer] for layer in sparse}


def test_save_pretrained_folder_loads_through_the_loader(tiny, tmp_path) -> None:
    """On disk experts are separate tensors (w1/w2/w3 for Mixtral); the loader stacks them."""
    tiny.save(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == tiny.family
    ids = _prompt(9, seed=4)
    torch.testing.assert_close(_logits(loaded.model, [9], torch.tensor(ids)), tiny.hf_logits(ids), **TOL)


def test_a_missing_expert_is_refused(tiny) -> None:
    state = dict(tiny.hf.state_dict())
    # per-expert spelling with expert 1 of layer 0 missing its down projection
    fused = state.pop("model.layers.0.mlp.experts.gate_up_proj")
    down = state.pop("model.layers.0.mlp.experts.down_proj")
    half = fused.shape[1] // 2
    parts = ("w1", "w3", "w2") if tiny.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if tiny.family == "mixtral" else "mlp"
    for e in range(fused.shape[0]):
        state[f"model.layers.0.{block}.experts.{e}.{parts[0]}.weight"] = fused[e, :half]
        state[f"model.layers.0.{block}.experts.{e}.{parts[1]}.weight"] = fused[e, half:]
        if e != 1:
            state[f"model.layers.0.{block}.experts.{e}.{parts[2]}.weight"] = down[e]
    with pytest.raises(ValueError, match="lacks"):
        build_model(tiny.config).load_weights(state.items())


def _per_token_loop(experts: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (x[t] @ experts.gate_up_proj[e].T).chunk(2)
            out[t] += w[t, k] * ((torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T)
    return out


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_execution_equals_a_per_token_loop(use_grouped_mm: bool) -> None:
    g = torch.Generator().manual_seed(0)
    experts = Experts(6, 16, 8)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=g))
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=g))
    x = torch.randn(11, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(11)])
    ids[:, 0] = 3  # a hot expert, and experts 0..5 mostly unused in slot 0
    w = torch.rand(11, 2, generator=g)
    with torch.no_grad():
        ref = _per_token_loop(experts, x, ids, w)
        order = ids.reshape(-1).argsort(stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=6)
        ys = run_experts_grouped(
            x[order // 2], counts, experts.gate_up_proj, experts.down_proj, use_grouped_mm
        )
        got = torch.zeros_like(x).index_add_(0, order // 2, ys * w.reshape(-1)[order][:, None])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert len(moe_blocks(experts)) == 0


def test_expert_load_is_served_in_metrics_and_load(tmp_path, make_tiny_moe) -> None:
    """A real engine server over a tiny Qwen2-MoE: after one completion, `/v1/load` and `/metrics`
    report per layer the tokens routed to each expert, the same counts in both."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

    tiny = make_tiny_moe("qwen2_moe", seed=5)
    tiny.save(tmp_path)
    loaded = load_model(str(tmp_path))
    engine = LLMEngine(
        loaded.model, EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=128), eos_token_ids=[2]
    )
    app = build_app(
        engine, loaded.tokenizer, ServerConfig(served_model_names=["tiny-moe"], max_model_len=128)
    )
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(
            "/v1/completions",
            json={
                "model": "tiny-moe",
                "prompt": "abcdef",
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        load = http.get("/v1/load").json()
        metrics = http.get("/metrics").text
    routed = load["expert_tokens"]
    assert list(routed) == ["0"]  # layer 1 is dense (mlp_only_layers)
    assert len(routed["0"]) == 8 and sum(routed["0"]) == (prompt_tokens + 4) * 3
    series = {
        (s.labels["layer"], s.labels["expert"]): s.value
        for fam in text_string_to_metric_families(metrics)
        if fam.name == "tokenops_engine_moe_expert_tokens"
        for s in fam.samples
        if s.name.endswith("_total")
    }
    assert series == {("0", str(e)): float(n) for e, n in enumerate(routed["0"])}


def test_mixtral_sliding_window_matches_hf() -> None:
    """Mixtral's optional window applies to every layer: 5 tokens here, 24-token prompts."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
    )
    hf = transformers.MixtralForCausalLM(cfg).float().eval()
    ours = build_model(ModelConfig.from_hf_config(hf.config.to_dict()))
    ours.load_weights(hf.state_dict().items())
    assert ours.config.layer_sliding == (True, True) and ours.config.sliding_window == 5
    ids = _prompt(24, seed=9)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(ours, [24], torch.tensor(ids)), ref, **TOL)
    wide = build_model(ours.config.with_overrides(layer_sliding=(), sliding_window=None))
    wide.load_weights(hf.state_dict().items())
    assert not torch.allclose(_logits(wide, [24], torch.tensor(ids))[-1], ref[-1], atol=1e-3)


# llama.cpp's architecture names (Mixtral is "llama" with an expert count) and its MoE tensor names
_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def write_moe_gguf(path, tiny, experts_type: str = "F32", keep=lambda gguf_name: True) -> None:
    """A float32 GGUF of the tiny HF MoE laid out as llama.cpp's converter writes it: experts as 3-D
    `ffn_{gate,up,down}_exps` (in `experts_type`, quantised by `gguf.quants`), the shared expert's
    gate as a vector, Mixtral's Q/K rows permuted; only the tensors `keep` names."""
    import gguf
    from gguf.quants import quantize

    from .test_loader import _permute, add_byte_tokenizer, add_decoder_shape

    cfg, arch = tiny.hf.config, _GGUF_ARCH[tiny.family]
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_shape(writer, cfg)
    writer.add_key_length(tiny.config.head_dim)
    writer.add_value_length(tiny.config.head_dim)
    writer.add_rope_freq_base(tiny.config.rope_theta)
    moe = tiny.config.moe
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if arch != "llama":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    add_byte_tokenizer(writer, cfg)
    qtype = getattr(gguf.GGMLQuantizationType, experts_type)

    def add(gguf_name: str, w, expert: bool = False) -> None:
        if not keep(gguf_name):
            return
        if expert and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for name, tensor in tiny.hf.state_dict().items():
        w = tensor.detach().float().numpy().copy()
        if name in top or name == "lm_head.weight":
            add(top.get(name, "output.weight"), w)
            continue
        layer, sub = name.split(".")[2], ".".join(name.split(".")[3:])
        if sub == "mlp.experts.gate_up_proj":
            half = w.shape[1] // 2
            add(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half].copy(), expert=True)
            add(f"blk.{layer}.ffn_up_exps.weight", w[:, half:].copy(), expert=True)
            continue
        if sub == "mlp.experts.down_proj":
            add(f"blk.{layer}.ffn_down_exps.weight", w, expert=True)
            continue
        base, _, kind = sub.rpartition(".")
        if arch == "llama" and base == "self_attn.q_proj":
            w = _permute(w, cfg.num_attention_heads)
        elif arch == "llama" and base == "self_attn.k_proj":
            w = _permute(w, cfg.num_key_value_heads)
        elif base == "mlp.shared_expert_gate":
            w = w[0].copy()
        add(f"blk.{layer}.{_GGUF_BLOCK[base]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_gguf_moe_file_gives_the_hf_folders_logits(family, make_tiny_moe, tmp_path) -> None:
    """llama.cpp's MoE layout read back: the same config (sparse and dense layers, shared expert)
    and the logits of the HF folder holding the same weights."""
    tiny = make_tiny_moe(family, seed=MOE_FAMILIES.index(family))
    (tmp_path / "hf").mkdir()
    tiny.save(tmp_path / "hf")
    write_moe_gguf(tmp_path / "tiny.gguf", tiny)
    folder = load_model(str(tmp_path / "hf"))
    gguf = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    assert gguf.config.moe == folder.config.moe and gguf.config.architecture == family
    ids = _prompt(13, seed=5)
    torch.testing.assert_close(
        _logits(gguf.model, [13], torch.tensor(ids)), _logits(folder.model, [13], torch.tensor(ids)), **TOL
    )


@pytest.mark.parametrize("mode", ["int8", "int8_dynamic"])
def test_quantized_experts_stay_close_to_float(mode, make_tiny_moe) -> None:
    """`--quantization` gives the routed experts the dense layers' int8 formats: a quarter of the
    float bytes, logits within a few percent of float's, and the engine applies it."""
    from tokenops.engine.models.moe import QuantizedExperts, quantize_experts
    from tokenops.engine.quantize import dynamic_int8_unavailable, weight_bytes

    if mode == "int8_dynamic" and dynamic_int8_unavailable("cpu"):
        pytest.skip(dynamic_int8_unavailable("cpu"))
    tiny = make_tiny_moe("qwen2_moe", seed=1)
    model = build_model(tiny.config)
    model.load_weights(tiny.hf.state_dict().items())
    experts = model.model.layers[0].mlp.experts
    float_bytes = weight_bytes(experts)
    assert quantize_experts(model, mode) == 1
    quantized = model.model.layers[0].mlp.experts
    # a quarter of the bytes plus per-channel scales (large here: the tiny experts have 32-64 inputs)
    assert isinstance(quantized, QuantizedExperts) and weight_bytes(quantized) < 0.35 * float_bytes
    ids = _prompt(29)
    want = _logits(tiny.model, [29], torch.tensor(ids))
    got = _logits(model, [29], torch.tensor(ids))
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert got.argmax(-1).eq(want.argmax(-1)).float().mean() > 0.9
    # the engine's quantization knob reaches the experts
    fresh = build_model(tiny.config)
    fresh.load_weights(tiny.hf.state_dict().items())
    LLMEngine(fresh, EngineConfig(num_kv_blocks=64, block_size=4, quantization=mode), eos_token_ids=[2])
    assert isinstance(fresh.model.layers[0].mlp.experts, QuantizedExperts)


def test_gguf_native_keeps_the_routed_experts_in_their_blocks(make_tiny_moe, tmp_path) -> None:
    """`gguf_native`: routed experts stored as Q4_0 stay 4-bit (int4 `QuantizedExperts` over the
    file's blocks, under a fifth of float32's bytes). Their outputs are within 2% of the float
    path's (the same blocks dequantised; the int4 kernel quantises activations to int8), and with
    only the experts differing the logits are within 3% of the largest and keep every argmax."""
    from tokenops.engine.models.moe import QuantizedExperts
    from tokenops.engine.quantize import weight_bytes

    tiny = make_tiny_moe("qwen3_moe", seed=4)
    write_moe_gguf(tmp_path / "tiny.gguf", tiny, experts_type="Q4_0")
    dense = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    native = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache", gguf_native=True)
    ids = torch.tensor(_prompt(29))
    got = _logits(native.model, [29], ids)
    xs = torch.randn(40, tiny.config.hidden_size, generator=torch.Generator().manual_seed(0))
    counts = torch.tensor([5] * tiny.config.moe.num_experts)
    for want_block, block in zip(moe_blocks(dense.model), moe_blocks(native.model), strict=True):
        assert isinstance(block.experts, QuantizedExperts)
        assert weight_bytes(block.experts) < 0.2 * weight_bytes(want_block.experts)
        want, out = want_block.experts.run(xs, counts), block.experts.run(xs, counts)
        assert (out - want).abs().max() < 0.02 * want.abs().max()
        block.experts = want_block.experts  # the float path's experts, everything else native
    want = _logits(native.model, [29], ids)
    assert (got - want).abs().max() < 0.03 * want.abs().max()
    assert got.argmax(-1).equal(want.argmax(-1))
