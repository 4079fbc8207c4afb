"""The benchmark-only experiments on the engine's layers, checked against their references: the
`torch._int_mm` variant of int8_dynamic (benchmarks/int_mm_linear.py) and the int8 output head
(benchmarks/logits_head.py). They live in benchmarks/ because the engine never uses them; they are
tested here because they need the engine's tiny models and kernels."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from tokenops.engine import kernels
from tokenops.engine.models.layers import derived_weight_bytes
from tokenops.engine.quantize import DynamicInt8Linear, dynamic_int8_unavailable, quantize_int8, weight_bytes

from .test_quantize_int8_dynamic import _engine, _reference

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


INT_MM = _load("int_mm_linear")
HEAD = _load("logits_head")
needs_fbgemm = pytest.mark.skipif(
    dynamic_int8_unavailable("cpu") is not None, reason="no fbgemm in this build"
)


def _int_mm_reference(layer: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """Float64 math on what `torch._int_mm` multiplies: each row of x int8 around its midpoint
    (offset (max + min) / 2, scale (max - min) / 254, round half even) times the int8 weights and
    their per-channel scales."""
    w8, scales = layer.unpacked()
    x2 = x.reshape(-1, x.shape[-1]).float()
    lo, hi = x2.amin(dim=1, keepdim=True), x2.amax(dim=1, keepdim=True)
    mid, half = (hi + lo) * 0.5, ((hi - lo) * 0.5).clamp(min=1e-30)
    xq = ((x2 - mid) * (torch.full_like(half, 127.0) / half)).round().clamp(-127, 127)
    x_deq = xq.double() * (half.double() / 127) + mid.double()
    out = x_deq @ (w8.double() * scales.double()[:, None]).t()
    return (out if layer.bias is None else out + layer.bias.double()).float().reshape(*x.shape[:-1], -1)


def _int_mm_layer(linear: nn.Linear, min_rows: int = 16) -> DynamicInt8Linear:
    layer = DynamicInt8Linear.from_linear(linear)
    assert INT_MM.use_int_mm(layer, min_rows) == 1
    return layer


def _torch_path(layer: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The `torch._int_mm` path with torch's quantise / rescale ops, at any row count."""
    with torch.inference_mode():
        return layer.int_mm(x.reshape(-1, layer.in_features), None)


@pytest.mark.parametrize("rows", [16, 17, 64, 128, 300])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(96, 40), (37, 23)])  # odd widths: the kernels' scalar tails
@pytest.mark.parametrize("native", [True, False])
@needs_fbgemm
def test_int_mm_path_equals_float_reference(rows, bias, shape, native):
    """From the threshold: `torch._int_mm` on symmetric int8 rows, native passes or torch ops."""
    if native and kernels.ops() is None:
        pytest.skip(f"native kernels unavailable: {kernels.build_error()}")
    torch.manual_seed(rows)
    lin = nn.Linear(*shape, bias=bias)
    layer = _int_mm_layer(lin)
    x = torch.randn(rows, shape[0]) * 2 + 0.3
    x[0] *= 1e4  # huge activations in a row: its scale alone, the others keep their precision
    x[1] = 0  # a row of zeros: zeros out (plus the bias), no NaN from its zero scale
    x[-1] *= 3e30
    with torch.inference_mode():
        if native:
            y = layer(x)
        else:
            y = _torch_path(layer, x)
    ref = _int_mm_reference(layer, x)
    # int32 sums are exact: only float rounding (of the rescale) separates path and reference, per row
    err = (y - ref).abs().amax(dim=1) / ref.abs().amax(dim=1).clamp(min=1e-30)
    assert err.max() < 1e-6
    assert y[1].equal(layer.bias if bias else torch.zeros(shape[1]))
    # the quantisation is real and per row: against the float layer the error is larger, yet small
    expect = lin(x).detach()
    rel = (y - expect).abs().amax(dim=1) / expect.abs().amax(dim=1)
    rows_nonzero = torch.ones(rows, dtype=torch.bool)
    rows_nonzero[1] = False
    assert rel[rows_nonzero].max() < 0.05
    assert (y - expect).abs().max() > 100 * (y - ref).abs().max()


@needs_fbgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_passes_equal_the_torch_ops_bit_for_bit(dtype):
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"native kernels unavailable: {kernels.build_error()}")
    torch.manual_seed(0)
    layer = _int_mm_layer(nn.Linear(70, 33))
    x = (torch.randn(40, 70) * 3).to(dtype)
    x[3] = 0
    x[5] *= 1e20
    q, s, o = ops.quantize_rows_s8(x)
    xf = x.float()
    lo, hi = xf.amin(dim=1, keepdim=True), xf.amax(dim=1, keepdim=True)
    mid, half = (hi + lo) * 0.5, ((hi - lo) * 0.5).clamp(min=1e-30)
    inv = torch.full_like(half, 127.0) / half
    assert q.equal(((xf - mid) * inv).round().clamp(-127, 127).to(torch.int8))
    assert s.equal((half / 127.0).flatten()) and o.equal(mid.flatten())
    assert int(q.max()) == 127 and int(q.min()) == -127  # the row's max and min: both ends of the range
    with torch.inference_mode():
        assert layer(x).equal(_torch_path(layer, x).to(dtype))
    acc = torch.randint(-(2**20), 2**20, (5, 33), dtype=torch.int32)
    rs, ro, cs, co, b = torch.rand(5), torch.randn(5), torch.rand(33), torch.randn(33), torch.randn(33)
    want = acc.float() * rs[:, None] * cs + ro[:, None] * co
    out = ops.rescale_rows_(acc.clone(), rs, ro, cs, co, b)
    assert out.dtype == torch.float32 and out.equal(want + b)
    assert ops.rescale_rows_(acc.clone(), rs, ro, cs, co, None).equal(want)


@needs_fbgemm
def test_path_by_row_count(monkeypatch):
    """fbgemm below the layer's min rows, `torch._int_mm` from them; without the native kernels from
    MIN_ROWS_TORCH; a plain DynamicInt8Linear keeps no int8 copy and runs fbgemm always."""
    torch.manual_seed(1)
    lin = nn.Linear(64, 24)
    layer = _int_mm_layer(lin)
    t = layer.int_mm_min_rows
    x = torch.randn(INT_MM.MIN_ROWS_TORCH + 1, 64)
    x[:, 0] += 40  # a large shared column: fbgemm's and _int_mm's roundings then differ visibly

    def close(y, ref):
        return bool((y - ref).abs().max() <= 1e-5 * ref.abs().max())

    with torch.inference_mode():
        if kernels.ops() is not None:
            below, at = layer(x[: t - 1]), layer(x[:t])
            head = x[: t - 1]
            assert close(below, _reference(layer, head)) and not close(below, _int_mm_reference(layer, head))
            assert close(at, _int_mm_reference(layer, x[:t])) and not close(at, _reference(layer, x[:t]))
        monkeypatch.setattr(kernels, "enabled", False)
        n = INT_MM.MIN_ROWS_TORCH
        assert close(layer(x[:t]), _reference(layer, x[:t]))
        assert close(layer(x[: n - 1]), _reference(layer, x[: n - 1]))
        assert close(layer(x[:n]), _int_mm_reference(layer, x[:n]))
    fb = DynamicInt8Linear.from_linear(lin)
    assert not any(hasattr(fb, name) for name in ("weight_int8", "weight_scales", "weight_offsets"))
    with torch.inference_mode():
        assert close(fb(x), _reference(fb, x))
    assert weight_bytes(layer) - weight_bytes(fb) == 64 * 24 + 8 * 24  # the int8 copy, its scales and offsets


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
def test_int8_logits_head_equals_dequantized_head(family, request, make_context):
    tiny = request.getfixturevalue(family)
    q = copy.deepcopy(tiny.model)
    HEAD.quantize_logits_head(q, kernel_max_rows=0)
    HEAD.quantize_logits_head(q)  # a second call keeps the first head
    twin = copy.deepcopy(tiny.model)
    head_q, _ = quantize_int8(twin.model.embed_tokens.weight)  # both tiny models tie their head
    hidden = torch.randn(5, tiny.config.hidden_size)
    with torch.no_grad():
        twin.model.embed_tokens.weight.copy_(q.logits_head_int8.dequantized_weight())
        torch.testing.assert_close(q.compute_logits(hidden), twin.compute_logits(hidden))
    assert q.logits_head_int8.weight_int8.equal(head_q)


@needs_fbgemm
def test_a_quantised_head_leaves_no_float_head_copies(tiny_llama):
    """A head that replaces compute_logits: the float head's derived copies are never built."""
    q = _engine(copy.deepcopy(tiny_llama.model), quantization="int8_dynamic")
    HEAD.quantize_logits_head(q.model, dynamic=True)
    assert derived_weight_bytes(q.model) == 0
    assert isinstance(q.model.logits_head_int8, DynamicInt8Linear)
