"""Weight-only int8 quantisation: the quantised linear against its dequantised reference, a tiny
model's greedy output against the same model running on the dequantised weights, the engine end to
end with `quantization="int8"`, and (bundled) SmolLM2's perplexity and greedy agreement vs float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.models.layers import MergedLinear
from tokenops.engine.quantize import (
    INT8_NATIVE_MAX_ROWS,
    Int8WeightOnlyLinear,
    has_int8pack_kernel,
    quantize_int8,
    quantize_model,
    weight_bytes,
)
from tokenops.engine.quantize.common import bf16_gemm_wins
from tokenops.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_quantize_int8_round_trip_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 40)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,)
    assert q.abs().max() <= 127
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 3, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_dequantized_reference(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(64, 96, bias=bias)
    qlin = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(rows, 64)
    ref = nn.functional.linear(x, qlin.dequantized_weight(), lin.bias)
    out = qlin(x)
    assert out.dtype == x.dtype and out.shape == (rows, 96)
    bf16_gemm = rows > INT8_NATIVE_MAX_ROWS and bf16_gemm_wins("cpu")
    if bf16_gemm or (rows <= qlin.kernel_max_rows and has_int8pack_kernel("cpu")):
        # the int8 kernel (and the bf16 GEMM of large batches where it beats float32's) takes bf16
        # activations: bf16 rounding (2^-8 relative) bounds the error
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    else:
        torch.testing.assert_close(out, ref)
    # the forced dequantise path is exact with respect to the dequantised weights
    exact = Int8WeightOnlyLinear.from_linear(lin, kernel_max_rows=0)
    torch.testing.assert_close(exact(x), ref)
    # and the quantised weights are close to the originals
    torch.testing.assert_close(ref, lin(x), rtol=0.05, atol=0.05)


def test_the_int8_kernel_probe_is_remembered_under_its_own_key(monkeypatch):
    """`has_int8pack_kernel`'s probe is kept as "int8:<device>" beside "bf16:cpu" and "int4:cpu" (it was
    kept as the bare device name, a key any other probe of that device could take)."""
    from tokenops.engine import quantize

    for answer in (True, False):
        monkeypatch.setitem(quantize.common._KERNEL_CACHE, "int8:cpu", answer)
        assert has_int8pack_kernel("cpu") is answer
    assert "cpu" not in quantize.common._KERNEL_CACHE


@pytest.mark.parametrize(
    ("native_bf16", "feature_set", "bf16_gemm"),
    [
        (True, "amx", True),
        (True, "avx512_bf16", True),
        (True, "avx512_bf16_intel", False),
        (False, "amx", False),
    ],
)
def test_prefill_rows_take_a_bf16_gemm_only_where_it_beats_float32(
    monkeypatch, native_bf16, feature_set, bf16_gemm
):
    from tokenops.engine import quantize

    monkeypatch.setitem(quantize.common._KERNEL_CACHE, "bf16:cpu", native_bf16)
    monkeypatch.setattr(quantize.common, "this_cpu_feature_set", lambda: feature_set)
    torch.manual_seed(0)
    qlin = Int8WeightOnlyLinear.from_linear(nn.Linear(64, 96))
    x = torch.randn(INT8_NATIVE_MAX_ROWS + 31, 64)
    with torch.inference_mode():
        out = qlin(x)
    bf16 = nn.functional.linear(x.bfloat16(), qlin.dequantized_weight(torch.bfloat16)).float() + qlin.bias
    assert torch.equal(out, bf16) == bf16_gemm
    ref = nn.functional.linear(x, qlin.dequantized_weight(), qlin.bias)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_3d_input_keeps_its_shape():
    qlin = Int8WeightOnlyLinear.from_linear(nn.Linear(32, 16))
    assert qlin(torch.randn(2, 5, 32)).shape == (2, 5, 16)


def test_quantize_model_replaces_every_linear_including_fused(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    before = weight_bytes(model)
    n = quantize_model(model, "int8")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert n == 4 * tiny_llama.config.num_layers  # qkv, o, gate_up, down per layer
    assert not linears and not any(isinstance(m, MergedLinear) for m in model.modules())
    assert weight_bytes(model) < before
    assert quantize_model(model, "int8") == 0  # idempotent
    assert quantize_model(model, None) == 0
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int3")


def _dequantized_twin(qmodel: nn.Module, fp_model: nn.Module) -> nn.Module:
    """`fp_model` with each linear weight replaced by its quantised-then-dequantised value."""
    twin = copy.deepcopy(fp_model)
    qmods = dict(qmodel.named_modules())
    with torch.no_grad():
        for name, m in twin.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(qmods[name].dequantized_weight())
    return twin


def _engine(model, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLMEngine(model, EngineConfig(**kw), eos_token_ids=[2])


PROMPTS = [[1, 17, 45, 99, 3, 8], [1, 200, 201, 5], [1] + list(range(30, 52))]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
def test_tiny_model_greedy_follows_dequantized_reference(family, request):
    # dequantise path: exact with respect to the dequantised weights, so tokens must match exactly
    tiny = request.getfixturevalue(family)
    q = copy.deepcopy(tiny.model)
    assert quantize_model(q, "int8", kernel_max_rows=0) > 0
    twin = _dequantized_twin(q, tiny.model)
    assert _engine(q).generate(PROMPTS, GREEDY) == _engine(twin).generate(PROMPTS, GREEDY)


def test_tiny_model_kernel_path_logits_close_to_dequantized_reference(tiny_llama, make_context):
    q = copy.deepcopy(tiny_llama.model)
    quantize_model(q, "int8")
    twin = _dequantized_twin(q, tiny_llama.model)
    ids = torch.tensor(PROMPTS[2])
    with torch.inference_mode():
        outs = [
            m.compute_logits(m(ids, make_context(tiny_llama.config, [len(ids)], [len(ids)])))
            for m in (q, twin)
        ]
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05 * outs[1].abs().max().item())
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.9


def test_engine_end_to_end_with_int8(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    engine = _engine(model, quantization="int8", max_num_batched_tokens=8)  # chunked prefill too
    assert any(isinstance(m, Int8WeightOnlyLinear) for m in engine.model.modules())
    outs = engine.generate(PROMPTS, GREEDY)
    assert [len(o) for o in outs] == [12] * 3
    assert engine.pool.num_used_blocks == 0
    # a mixed batch gives the same tokens as each prompt alone (row counts change the kernel path
    # only above INT8_NATIVE_MAX_ROWS and KERNEL_MAX_ROWS)
    alone = [_engine(model, quantization="int8").generate([p], GREEDY)[0] for p in PROMPTS]
    assert alone == outs


def test_config_rejects_unknown_mode():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


# --- bundled: SmolLM2 quality vs float32 -----------------------------------------------------------

TEXT = (
    "The river rises in the hills to the north of the town and flows south through farmland before "
    "it reaches the sea. In the spring the water is high and fast, and the old stone bridge near the "
    "market has been closed more than once. Farmers along its banks grow wheat, barley and potatoes, "
    "and in the autumn the fields are ploughed and left bare until the next planting. The town itself "
    "grew up around the crossing, and its oldest buildings still stand close to the water."
)


def perplexity_and_top1(model, token_ids: list[int], make_context) -> tuple[float, torch.Tensor]:
    ids = torch.tensor(token_ids)
    n = len(token_ids)
    with torch.inference_mode():
        logits = model.compute_logits(
            model(ids, make_context(model.config, [n], [n], block_size=16, num_blocks=n // 16 + 2))
        )
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
    return float(torch.exp(nll)), logits.argmax(-1)


@pytest.fixture
def one_thread():
    """One intra-op thread, restored after: two OpenMP threads on a busy shared machine crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.bundled
def test_smollm2_int8_quality(bundled_model, make_context, one_thread):
    loaded = bundled_model("smollm2-135m-instruct")
    fp = loaded.model
    q = copy.deepcopy(fp)  # the session's model stays float32
    quantize_model(q, "int8")
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    ppl_fp, top_fp = perplexity_and_top1(fp, ids, make_context)
    ppl_q, top_q = perplexity_and_top1(q, ids, make_context)
    top1 = float((top_fp == top_q).float().mean())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [ids[:20], ids[30:45]]
    g_fp = LLMEngine(fp, EngineConfig(num_kv_blocks=32)).generate(prompts, params)
    g_q = LLMEngine(q, EngineConfig(num_kv_blocks=32)).generate(prompts, params)
    same = sum(a == b for x, y in zip(g_fp, g_q, strict=True) for a, b in zip(x, y, strict=True))
    print(
        f"\nSmolLM2 int8 vs fp32 on {len(ids)} tokens: perplexity {ppl_fp:.3f} -> {ppl_q:.3f} "
        f"({(ppl_q / ppl_fp - 1) * 100:+.2f}%), teacher-forced top-1 agreement {top1:.3f}, "
        f"greedy tokens equal {same}/{sum(map(len, g_fp))}"
    )
    assert abs(ppl_q / ppl_fp - 1) < 0.10
    assert top1 >= 0.8
