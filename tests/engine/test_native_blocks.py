"""The native block-quantised matmuls (kernels/csrc/linear_blocks.cpp): 4-bit (W4A8) and int8 (W8A8,
Q8_0) weights in blocks of 32 against activations quantised to int8 per block of 32, against float64
math on the same codes and the same quantised activations (a reference written here from the
layouts' definition), for odd shapes, every group size, 1..70 rows (past the kernel's 64-row chunk),
bias or not; the int4 layer and the Q8_0 output head that run them, against their weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.quantize.common import q8_tiles, quantize_q8_blocks
from tokenops.engine.quantize.int4 import (
    Int4WeightOnlyLinear,
    codes_of_native_blocks,
    dequantize_int4,
    native_blocks,
    native_params,
    params_of_native_params,
    quantize_int4,
)


def _quantise_rows(x: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_1 as the kernel computes it: per block of 32, d = max|x| / 127, q = round-half-even(x / d)."""
    xb = F.pad(x, (0, padded - x.shape[1])).view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (xb * inv[..., None]).round(), d


def _reference(x, codes, d, m, group, bias):
    """float64 sum over blocks of d_w * d_x * sum(code * q) + m * d_x * sum(q)."""
    q, dx = _quantise_rows(x, codes.shape[1])
    rows, blocks = dx.shape
    per_group = group // 32
    dw = d.double().repeat_interleave(per_group, dim=1)  # [out, blocks]
    mw = m.double().repeat_interleave(per_group, dim=1)
    c = codes.double().view(codes.shape[0], blocks, 32)
    dots = torch.einsum("obi,rbi->rob", c, q.double())  # [rows, out, blocks]
    y = (dots * dw[None] * dx.double()[:, None]).sum(-1)
    y += (mw[None] * (dx.double() * q.double().sum(-1))[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


# (out, in, group): `in` below / at / past a block and a group, `out` below / past / not a multiple of the
# kernel's 8-row tile
SHAPES = [
    (1, 32, 32),
    (5, 32, 32),
    (7, 17, 32),
    (9, 96, 32),
    (16, 96, 32),
    (4, 96, 64),
    (6, 160, 128),
    (33, 576, 32),
    (130, 1536, 64),
]


def _weights(out_f, in_f, group, seed):
    torch.manual_seed(seed)
    padded = -(-in_f // group) * group
    codes = torch.randint(0, 16, (out_f, padded), dtype=torch.uint8)
    codes[:, in_f:] = 8  # what quantize_int4's zero padding gives: irrelevant, x is zero there
    d = torch.rand(out_f, padded // group) * 0.02 + 1e-3
    m = -8 * d + torch.randn(out_f, padded // group) * 0.01
    return codes, d, m


def _q4(native, x, codes, d, m, group, bias):
    """linear_q4 on the weights in its tile layout."""
    d, m = native_params(d), native_params(m)
    return native.linear_q4(x, native_blocks(codes), d, m, codes.shape[0], group, bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 32, 70])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_q4_equals_float64_reference(native, rows, shape, bias):
    out_f, in_f, group = shape
    codes, d, m = _weights(out_f, in_f, group, seed=rows * 100 + in_f)
    x = torch.randn(rows, in_f) * 3
    b = torch.randn(out_f) if bias else None
    y = _q4(native, x, codes, d, m, group, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    ref = _reference(x, codes, d, m, group, b)
    w = codes.float() * d.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
    tol = 1e-5 * (x.abs() @ w[:, :in_f].abs().t()).max().item() + 1e-5
    assert (y.double() - ref).abs().max().item() <= tol
    # and near the float math: int8 activations lose about 1/254 of each block's largest value
    exact = F.linear(x.double(), w[:, :in_f].double(), None if b is None else b.double())
    assert (y.double() - exact).abs().max().item() <= 0.01 * (x.abs() @ w[:, :in_f].abs().t()).max().item()


def test_a_rows_result_does_not_depend_on_the_row_count_or_threads(native):
    codes, d, m = _weights(24, 576, 32, seed=1)
    x = torch.randn(70, 576)
    alone = _q4(native, x[:1].contiguous(), codes, d, m, 32, None)[0]
    for rows in (2, 3, 4, 5, 8, 33, 64, 65, 70):
        assert torch.equal(_q4(native, x[:rows].contiguous(), codes, d, m, 32, None)[0], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _q4(native, x, codes, d, m, 32, None)
        torch.set_num_threads(2)
        two = _q4(native, x, codes, d, m, 32, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_threads_taking_each_others_tiles_compute_every_output_once_the_same_way(native):
    # more threads than cores: the OS parks some mid-call, so the others finish their shares and take
    # the parked ones' tiles (and row chunks: 200 rows are four); every output must come out as one
    # thread computes it, none left as the uninitialised output
    codes, d, m = _weights(1552, 576, 32, seed=3)
    tiles, dp, mp = native_blocks(codes), native_params(d), native_params(m)
    x = torch.randn(200, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear_q4(x, tiles, dp, mp, 1552, 32, None)
        gated_one = native.linear_q4_silu_mul(x, tiles, dp, mp, 1552, 32)
        for n in (3, 5, 8):
            torch.set_num_threads(n)
            for _ in range(5):
                assert torch.equal(native.linear_q4(x, tiles, dp, mp, 1552, 32, None), one)
                assert torch.equal(native.linear_q4_silu_mul(x, tiles, dp, mp, 1552, 32), gated_one)
    finally:
        torch.set_num_threads(threads)


# (gate | up outputs, in, group): a gate half of 1, 2 and 3 tiles (the AVX-512 builds' tile pairs and a
# single tile after them), SmolLM2's MLP, and halves no whole number of tiles (the two-op path)
GATED_SHAPES = [
    (16, 96, 32),
    (32, 160, 32),
    (48, 576, 64),
    (3072, 576, 32),
    (2 * 13, 96, 32),
    (2 * 36, 64, 32),
]


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 33, 70, 130])
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("half", [False, True])
def test_gate_up_with_its_activation_is_the_two_ops_bits(native, rows, shape, half):
    out_f, in_f, group = shape
    codes, d, m = _weights(out_f, in_f, group, seed=rows + out_f)
    x = torch.randn(rows, in_f) * 3
    if rows > 1:
        x[1] = 0.0  # a zero row: every gate is 0.0 (+ 0.f in both paths)
    dp, mp = native_params(d), native_params(m)
    if half:
        dp, mp = dp.half(), mp.half()
    tiles = native_blocks(codes)
    fused = native.linear_q4_silu_mul(x, tiles, dp, mp, out_f, group)
    two_ops = native.silu_mul(native.linear_q4(x, tiles, dp, mp, out_f, group, None))
    assert fused.shape == (rows, out_f // 2) and fused.dtype == torch.float32
    assert torch.equal(fused.view(torch.int32), two_ops.view(torch.int32))  # the sign of a zero too
    w = codes.float() * d.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
    gate_up = x @ w[:, :in_f].t()
    ref = F.silu(gate_up[:, : out_f // 2]) * gate_up[:, out_f // 2 :]
    assert (fused - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 1e-3  # int8 activations


def test_gate_up_with_its_activation_keeps_its_bits_across_threads_and_refuses_odd_widths(native):
    codes, d, m = _weights(3072, 576, 32, seed=7)
    x = torch.randn(70, 576)
    tiles, dp, mp = native_blocks(codes), native_params(d), native_params(m)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear_q4_silu_mul(x, tiles, dp, mp, 3072, 32)
        torch.set_num_threads(2)
        two = native.linear_q4_silu_mul(x, tiles, dp, mp, 3072, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(native.linear_q4_silu_mul(x[:1].contiguous(), tiles, dp, mp, 3072, 32)[0], one[0])
    codes, d, m = _weights(7, 96, 32, seed=1)
    with pytest.raises(RuntimeError, match="must be even"):
        native.linear_q4_silu_mul(
            x[:, :96].contiguous(), native_blocks(codes), native_params(d), native_params(m), 7, 32
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("half", [False, True])
def test_amx_tiles_give_the_vpdpbusd_tiles_bits(native, shape, half):
    """Where AMX-INT8 runs, calls of many rows take TDPBSUD over the same integer sums: bit-for-bit the
    vpdpbusd tiles' outputs, for odd tile counts, partial groups of 16 rows and every group size."""
    shipped = native.set_blocks_amx_min_rows(7)  # the setting round-trips on every build
    assert native.set_blocks_amx_min_rows(shipped) == 7 and shipped == 16
    with pytest.raises(RuntimeError, match="at least 1"):
        native.set_blocks_amx_min_rows(0)
    if not native.blocks_amx():
        pytest.skip("this CPU (or build) has no AMX-INT8")
    out_f, in_f, group = shape
    codes, d, m = _weights(out_f, in_f, group, seed=out_f + in_f)
    dn, mn = native_params(d), native_params(m)
    if half:
        dn, mn = dn.half(), mn.half()
    packed = native_blocks(codes)
    bias = torch.randn(out_f)
    _assert_amx_gives_the_vector_tiles_bits(
        native, in_f, lambda x, b: native.linear_q4(x, packed, dn, mn, out_f, group, b), bias
    )


def _assert_amx_gives_the_vector_tiles_bits(native, in_f, linear, bias):
    """linear(x, bias) on AMX's tiles (from one row) equals the vpdpbusd tiles' (AMX held off) bit for
    bit, at row counts around a group of 16 and past the pair chunks' 48, odd ones with the bias."""
    shipped = native.set_blocks_amx_min_rows(1)
    try:
        for rows in (1, 15, 16, 17, 40, 130):
            x = torch.randn(rows, in_f) * 3
            b = bias if rows % 2 else None
            native.set_blocks_amx_min_rows(1)
            amx = linear(x, b)
            native.set_blocks_amx_min_rows(1 << 30)
            assert torch.equal(amx, linear(x, b)), rows
    finally:
        native.set_blocks_amx_min_rows(shipped)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_float16_parameters_give_the_float32_results(native, rows):
    """d and m held as float16 (a GGUF file's Q4_0 / Q4_1 values) read back as the same float32 values:
    bit-for-bit the float32 parameters' outputs; mixed dtypes are refused."""
    codes, d, m = _weights(40, 576, 32, seed=rows)
    d, m = native_params(d).half(), native_params(m).half()
    x = torch.randn(rows, 576)
    packed = native_blocks(codes)
    half = native.linear_q4(x, packed, d, m, 40, 32, None)
    assert torch.equal(half, native.linear_q4(x, packed, d.float(), m.float(), 40, 32, None))
    with pytest.raises(RuntimeError, match="of one dtype"):
        native.linear_q4(x, packed, d, m.float(), 40, 32, None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("half", [False, True])
def test_dequantize_q4_bf16_is_the_tiles_weights_rounded_once(native, shape, half):
    """`dequantize_q4_bf16`: w = code * d + m in one float32 rounding, then to the nearest bf16 (ties
    to even), row-major over the padded width; float16 parameters read as their float32 values."""
    out_f, in_f, group = shape
    codes, d, m = _weights(out_f, in_f, group, seed=in_f + out_f)
    if half:
        d, m = d.half().float(), m.half().float()
    dt, mt = native_params(d), native_params(m)
    if half:
        dt, mt = dt.half(), mt.half()
    w = native.dequantize_q4_bf16(native_blocks(codes), dt, mt, out_f, group)
    assert w.dtype == torch.bfloat16 and w.shape == codes.shape
    # code * d + m is exact in float64 here: .float() is the one float32 rounding an FMA makes
    exact = codes.double() * d.double().repeat_interleave(group, 1) + m.double().repeat_interleave(group, 1)
    assert torch.equal(w, exact.float().bfloat16())


def test_dequantize_q4_bf16_refuses_bad_inputs(native):
    codes, d, m = _weights(9, 64, 32, seed=3)
    packed, dt, mt = native_blocks(codes), native_params(d), native_params(m)
    with pytest.raises(RuntimeError, match="tiles of 8 rows"):
        native.dequantize_q4_bf16(packed, dt, mt, 17, 32)
    with pytest.raises(RuntimeError, match="power of two"):
        native.dequantize_q4_bf16(packed, dt, mt, 9, 48)
    with pytest.raises(RuntimeError, match="of one dtype"):
        native.dequantize_q4_bf16(packed, dt, mt.half(), 9, 32)
    with pytest.raises(RuntimeError, match="uint8"):
        native.dequantize_q4_bf16(packed.to(torch.int8), dt, mt, 9, 32)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
@pytest.mark.parametrize("rows", [1, 127, 128, 159, 160, 300, 320])
def test_int4_layer_takes_one_bf16_gemm_for_many_rows_where_it_wins(native, monkeypatch, rows, amx):
    """From `bf16_gemm_min_rows()` rows (320 where the tiles run on AMX-INT8, else 128), where bf16 runs
    on AMX's tiles (forced here), the layer dequantises
    its tiles to bf16 and runs one bf16 GEMM on bf16 activations; fewer rows take the tiles, and so
    does every row count without AMX (AVX512-BF16 alone included)."""
    from tokenops.engine.models import layers
    from tokenops.engine.quantize import int4

    monkeypatch.setattr(int4, "block_kernels", lambda device: True)
    monkeypatch.setattr(int4, "has_bf16_tiles", lambda device: amx)
    torch.manual_seed(rows)
    lin = nn.Linear(150, 48, bias=True)  # 150 inputs: padded to 160
    layer = Int4WeightOnlyLinear.from_linear(lin, 32)
    x = torch.randn(rows, 150)
    with torch.inference_mode():
        out = layer(x)
        d, m, bias = layer._native_args()
        tiles = native.linear_q4(x, layer.weight_packed, d, m, 48, 32, bias)
    w = layer._dequantized(torch.float32)
    assert int4.bf16_gemm_min_rows() == (320 if native.blocks_amx() else 128)
    if amx and rows >= int4.bf16_gemm_min_rows():
        # rows padded to the GEMM's row bucket, as the layer calls it
        xp = F.pad(x, (0, 10, 0, -rows % layers.GEMM_ROW_BUCKET)).bfloat16()
        gemm = F.linear(xp, w.bfloat16())[:rows].float() + lin.bias
        assert torch.equal(out, gemm)
    else:
        assert torch.equal(out, tiles)
    ref = x @ w[:, :150].T + lin.bias
    assert (out - ref).abs().max().item() <= 0.02 * (x.abs() @ w[:, :150].abs().T).max().item()


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
@pytest.mark.parametrize("rows", [1, 33, 200])
def test_llama_mlp_runs_an_int4_gate_up_and_its_activation_in_one_pass_where_it_takes_the_tiles(
    native, monkeypatch, rows, amx
):
    """The op-by-op MLP (a step's first and last layers) takes `linear_q4_silu_mul` where the int4
    gate|up projection takes the tiles, with the two ops' bits; many rows where bf16 GEMMs win, a
    bias, or bf16 activations keep the two ops."""
    from types import SimpleNamespace

    from tokenops.engine.models.llama import LlamaMLP
    from tokenops.engine.quantize import int4

    monkeypatch.setattr(int4, "block_kernels", lambda device: True)
    monkeypatch.setattr(int4, "has_bf16_tiles", lambda device: amx)
    torch.manual_seed(rows)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=96, intermediate_size=64, hidden_act="silu"))
    mlp.gate_up_proj = Int4WeightOnlyLinear.from_linear(nn.Linear(96, 128, bias=False), 32)
    mlp.down_proj = Int4WeightOnlyLinear.from_linear(nn.Linear(64, 96, bias=False), 32)
    calls = []
    real = int4.Int4WeightOnlyLinear.forward_silu_mul
    monkeypatch.setattr(
        int4.Int4WeightOnlyLinear, "forward_silu_mul", lambda self, x: calls.append(r := real(self, x)) or r
    )
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = mlp.forward(x)
        two_ops = mlp.down_proj.forward(native.silu_mul(mlp.gate_up_proj.forward(x)))
    assert torch.equal(out, two_ops)
    one_pass = not (amx and rows >= int4.bf16_gemm_min_rows())
    assert len(calls) == 1 and (calls[0] is not None) == one_pass
    with torch.inference_mode():
        assert mlp.gate_up_proj.forward_silu_mul(x.bfloat16()) is None
        biased = Int4WeightOnlyLinear.from_linear(nn.Linear(96, 128, bias=True), 32)
        assert biased.forward_silu_mul(x) is None


def test_int4_layer_keeps_float16_parameters_only_when_exact(native):
    from tokenops.engine.quantize.common import block_kernels
    from tokenops.engine.quantize.int4 import Int4WeightOnlyLinear

    if not block_kernels(torch.device("cpu")):
        pytest.skip("the int4 layer keeps the tiles only where the block kernels run (AVX2, or vpdpbusd)")
    codes, d, m = _weights(16, 64, 32, seed=7)
    d16, m16 = d.half().float(), m.half().float()  # float16 values, as a GGUF file's
    exact = Int4WeightOnlyLinear(codes, d16, m16 + 8 * d16, 64)
    assert exact.scales_and_zeros.dtype == torch.float16
    other = Int4WeightOnlyLinear(codes, d16 * (1 + 2**-12), m16 + 8 * d16, 64)
    assert other.scales_and_zeros.dtype == torch.float32
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(exact(x), x @ exact._dequantized(torch.float32).t(), atol=0.05, rtol=0.02)


def test_zero_rows_and_leading_dimensions(native):
    codes, d, m = _weights(8, 64, 32, seed=2)
    assert _q4(native, torch.randn(0, 64), codes, d, m, 32, None).shape == (0, 8)
    x = torch.randn(2, 3, 64)
    assert torch.equal(
        _q4(native, x, codes, d, m, 32, None)[1, 2],
        _q4(native, x[1, 2:3].contiguous(), codes, d, m, 32, None)[0],
    )


def test_bad_inputs_are_refused(native):
    codes, d, m = _weights(8, 64, 32, seed=3)
    packed, dt, mt = native_blocks(codes), native_params(d), native_params(m)
    with pytest.raises(RuntimeError, match="does not match"):
        native.linear_q4(torch.randn(2, 65), packed, dt, mt, 8, 32, None)
    with pytest.raises(RuntimeError, match="float32"):
        native.linear_q4(torch.randn(2, 64).bfloat16(), packed, dt, mt, 8, 32, None)
    with pytest.raises(RuntimeError, match="group_size"):
        native.linear_q4(torch.randn(2, 64), packed, dt, mt, 8, 48, None)
    with pytest.raises(RuntimeError, match="d and m"):
        native.linear_q4(torch.randn(2, 64), packed, dt[:, :8].contiguous(), mt, 8, 32, None)
    with pytest.raises(RuntimeError, match="tiles of 8 rows"):
        native.linear_q4(torch.randn(2, 64), packed, dt, mt, 9, 32, None)


def test_tile_layout_round_trips():
    codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    packed = native_blocks(codes)
    assert packed.shape == (1, 3 * 128)  # one tile of 8 rows (3 padding), 3 blocks of 128 bytes
    # chunk 0 of block 0: byte 4r + u = row r's input u (low nibble) and 16 + u (high)
    assert torch.equal(packed[0, 0:4] & 15, codes[0, 0:4])
    assert torch.equal(packed[0, 0:4] >> 4, codes[0, 16:20])
    assert torch.equal(packed[0, 4:8] & 15, codes[1, 0:4])
    # chunk 1: inputs 4..7 and 20..23; block 1 starts 128 bytes on
    assert torch.equal(packed[0, 32:36] & 15, codes[0, 4:8])
    assert torch.equal(packed[0, 128:132] & 15, codes[0, 32:36])
    assert int(packed[0, 20:32].max()) == 0  # rows 5..7 do not exist
    assert torch.equal(codes_of_native_blocks(packed, 5), codes)
    d = torch.rand(5, 3)
    tiled = native_params(d)
    assert tiled.shape == (1, 24) and tiled[0, 8 + 1] == d[1, 1] and int(tiled[0, 5:8].abs().sum()) == 0
    assert torch.equal(params_of_native_params(tiled, 5), d)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_native_int4_layer_is_close_to_its_dequantised_weights(native, monkeypatch, group, rows):
    """The layer in the native layout (forced here on any CPU) against float32 math on the weights it
    stands for; 300 rows take the dequantised GEMM past NATIVE_MAX_ROWS (lowered here), exact."""
    from tokenops.engine.quantize import int4

    monkeypatch.setattr(int4, "block_kernels", lambda device: True)
    monkeypatch.setattr(int4, "NATIVE_MAX_ROWS", 256)
    torch.manual_seed(group + rows)
    lin = nn.Linear(160, 48, bias=True)
    layer = Int4WeightOnlyLinear.from_linear(lin, group)
    assert layer.native and not layer.kernel
    codes, scales, zeros = quantize_int4(lin.weight, group)
    w = dequantize_int4(codes, scales, zeros)[:, :160]
    x = torch.randn(rows, 160)
    with torch.inference_mode():
        out = layer(x)
    ref = x @ w.T + lin.bias
    if rows > int4.NATIVE_MAX_ROWS:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert (out - ref).abs().max().item() <= 0.01 * (x.abs() @ w.abs().T).max().item()
    torch.testing.assert_close(layer._dequantized(torch.float32)[:, :160], w, atol=1e-6, rtol=1e-6)


def _q8(native, x, codes, d, bias=None):
    """linear_q8 on Q8_0 row codes, in its tile layout."""
    return native.linear_q8(x, *q8_tiles(codes, d), codes.shape[0], bias)


def _q8_in_block_order(x, codes, d):
    """What every output of linear_q8 is: float32 acc = fma(float(exact integer block sum), d_w * d_x,
    acc) over the blocks in order (each fused step in float64, exact for a float32 product and sum,
    then rounded once to float32)."""
    q, dx = _quantise_rows(x, codes.shape[1])
    blocks = dx.shape[1]
    dots = torch.einsum("obi,rbi->rob", codes.long().view(codes.shape[0], blocks, 32), q.long())
    scale = d[None] * dx[:, None]  # float32 products, [rows, out, blocks]
    acc = torch.zeros(x.shape[0], codes.shape[0])
    for b in range(blocks):
        acc = (dots[..., b].double() * scale[..., b].double() + acc.double()).float()
    return acc


def test_q8_tile_layout():
    codes = torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    d = torch.rand(5, 2)
    packed, tiled = q8_tiles(codes, d)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2 * 256)  # one tile (3 rows padding), 2 blocks
    # chunk c of a block: byte 4r + u = row r's input 4c + u; block 1 starts 256 bytes on
    assert torch.equal(packed[0, 0:4], codes[0, 0:4])
    assert torch.equal(packed[0, 4:8], codes[1, 0:4])
    assert torch.equal(packed[0, 32 * 7 + 8 : 32 * 7 + 12], codes[2, 28:32])
    assert torch.equal(packed[0, 256 + 32 + 16 : 256 + 32 + 20], codes[4, 36:40])
    assert int(packed[0, 20:32].abs().max()) == 0  # rows 5..7 do not exist
    assert tiled.shape == (1, 16) and tiled[0, 8 + 3] == d[3, 1] and int(tiled[0, 5:8].abs().sum()) == 0


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 32, 33, 64, 70])
@pytest.mark.parametrize(("out_f", "in_f"), [(1, 32), (5, 17), (9, 96), (130, 576), (61, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_q8_equals_float64_reference(native, rows, out_f, in_f, bias):
    torch.manual_seed(rows * 100 + in_f)
    w = torch.randn(out_f, in_f) * 0.05
    codes, d = quantize_q8_blocks(w)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127 and codes.shape[1] % 32 == 0
    x = torch.randn(rows, in_f) * 3
    b = torch.randn(out_f) if bias else None
    y = _q8(native, x, codes, d, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    # to the bit: one float32 accumulator per output in block order, then the bias
    exact = _q8_in_block_order(x, codes, d)
    assert torch.equal(y, exact if b is None else exact + b)
    q, dx = _quantise_rows(x, codes.shape[1])
    blocks = dx.shape[1]
    dots = torch.einsum("obi,rbi->rob", codes.double().view(out_f, blocks, 32), q.double())
    ref = (dots * d.double()[None] * dx.double()[:, None]).sum(-1)
    ref = ref if b is None else ref + b.double()
    wq = (codes.float().view(out_f, blocks, 32) * d[..., None]).view(out_f, -1)[:, :in_f]
    scale = (x.abs() @ wq.abs().t()).max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * scale + 1e-5
    # Q8_0 against the float weight: both sides lose about 1/254 of each block's largest value
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert (y.double() - exact).abs().max().item() <= 0.02 * scale


def test_linear_q8_is_exact_at_the_int16_bound(native):
    """Codes and activations at +-127 (and a -128 code) in every input: each vpmaddubsw pair sum is at its
    largest, 2 x 128 x 127, and the block sum 32 x 127 x 127 still converts to float exactly."""
    codes = torch.full((9, 64), 127, dtype=torch.int8)
    codes[1] = -127
    codes[2, ::2] = -128
    codes[3, ::3] = -127
    d = torch.ones(9, 2)
    x = torch.full((3, 64), 5.0)
    x[1] = -5.0
    x[2, 1::2] = -5.0
    y = _q8(native, x, codes, d)
    assert torch.equal(y, _q8_in_block_order(x, codes, d))
    assert y[0, 0].item() == pytest.approx(64 * 127 * 5.0, rel=1e-6)


@pytest.mark.parametrize(("out_f", "in_f"), [(9, 96), (130, 576), (61, 200), (49152 // 64, 576)])
def test_linear_q8_on_amx_tiles_gives_the_vpdpbusd_tiles_bits(native, out_f, in_f):
    """Where AMX-INT8 runs, linear_q8 calls of many rows take TDPBSSD over the same integer sums: the
    vpdpbusd tile pairs' outputs bit for bit, for odd tile counts, partial groups of 16 rows and a
    head-shaped call."""
    if not native.blocks_amx():
        pytest.skip("this CPU (or build) has no AMX-INT8")
    torch.manual_seed(out_f + in_f)
    codes, d = quantize_q8_blocks(torch.randn(out_f, in_f) * 0.05)
    packed, tiled = q8_tiles(codes, d)
    _assert_amx_gives_the_vector_tiles_bits(
        native, in_f, lambda x, b: native.linear_q8(x, packed, tiled, out_f, b), torch.randn(out_f)
    )


def test_linear_q8_rows_do_not_depend_on_the_batch_or_threads(native):
    torch.manual_seed(4)
    codes, d = quantize_q8_blocks(torch.randn(45, 576))
    packed, tiled = q8_tiles(codes, d)
    x = torch.randn(70, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [native.linear_q8(x[i : i + 1].contiguous(), packed, tiled, 45, None)[0] for i in range(32)]
        one_thread = native.linear_q8(x[:32].contiguous(), packed, tiled, 45, None)
        torch.set_num_threads(2)
        two_threads = native.linear_q8(x[:32].contiguous(), packed, tiled, 45, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, torch.stack(alone)) and torch.equal(two_threads, one_thread)
    for rows in range(2, 71):  # every remainder of the 4-row passes, across the 64-row chunk
        y = native.linear_q8(x[:rows].contiguous(), packed, tiled, 45, None)
        assert torch.equal(y[0], alone[0]) and torch.equal(y[min(rows, 32) - 1], alone[min(rows, 32) - 1])
    with pytest.raises(RuntimeError, match="linear_q8: d must be"):
        native.linear_q8(x, packed, tiled[:, :8].contiguous(), 45, None)
    with pytest.raises(RuntimeError, match="linear_q8: codes hold 6 tiles of 8 rows, not the 49"):
        native.linear_q8(x, packed, tiled, 49, None)
    with pytest.raises(RuntimeError, match="linear_q8: x's last dimension"):
        native.linear_q8(torch.randn(2, 540), packed, tiled, 45, None)


@pytest.mark.parametrize("rows", [1, 8, 9, 37, 130])
def test_q8_head_logits_are_close_to_float32(native, tiny_llama, rows):
    """The output head's Q8_0 tiles (VocabProjection.q8, set for the quantised modes where the block
    kernels run) against the float32 head on the same hidden states, at every row count: close logits
    with the same argmax almost everywhere, `linear_q8`'s to the bit; the derived bytes count the Q8_0
    copy alone, and no float32 copy is built."""
    from tokenops.engine.models.layers import VocabProjection, derived_weight_bytes, onednn_linear_available

    model = tiny_llama.model
    head = model.vocab_projection
    assert isinstance(head, VocabProjection)
    weight = model.model.embed_tokens.weight
    torch.manual_seed(rows)
    hidden = torch.randn(rows, model.config.hidden_size)
    with torch.inference_mode():
        ref = model.compute_logits(hidden)
        float_bytes = derived_weight_bytes(model)
        q8_head = VocabProjection()
        try:
            model.vocab_projection = q8_head
            q8_head.q8 = True
            out = model.compute_logits(hidden)
            q8_bytes = derived_weight_bytes(model)
        finally:
            model.vocab_projection = head
    assert torch.equal(out, _q8(native, hidden, *quantize_q8_blocks(weight)))
    assert 0 < (out - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.75
    assert q8_head._q8.value is not None
    assert q8_head._packed.value is None and q8_head._transposed.value is None
    # the float32 head's copies (transposed, prepacked) give way to int8 codes and a scale per 32
    n = weight.numel()
    assert q8_bytes == float_bytes - n * 4 * (2 if onednn_linear_available() else 1) + n + n // 8


def test_an_int4_gated_mlp_hands_bf16_from_gate_up_to_down(native, tiny_llama, monkeypatch):
    """Where many rows take the bf16 GEMM (AMX forced here), a gated MLP's gate|up projection hands
    its bf16 output on uncast, the activation reads and writes bf16 and the down projection answers
    in the model's dtype, as the bf16 weights' MLP does. Rows that take the tiles are untouched."""
    import copy

    from tokenops.engine.models.layers import silu_and_mul
    from tokenops.engine.quantize import int4, quantize_model

    monkeypatch.setattr(int4, "has_bf16_tiles", lambda device: True)
    model = copy.deepcopy(tiny_llama.model)
    quantize_model(model, "int4")
    mlp = model.model.layers[0].mlp
    up, down = mlp.gate_up_proj, mlp.down_proj
    if not up.native:
        pytest.skip("int4 keeps the tiles only where the block kernels run")
    attn = model.model.layers[0].self_attn
    assert up.keeps_bf16 and up.out_dtype == down.out_dtype == torch.float32
    # a Llama layer's output projections hand bf16 on to its norms (the next test): set aside here
    assert down.keeps_bf16 and attn.o_proj.keeps_bf16 and not attn.qkv_proj.keeps_bf16
    down.keeps_bf16 = False
    torch.manual_seed(0)
    many, few = torch.randn(int4.bf16_gemm_min_rows() + 8, 64), torch.randn(5, 64)
    with torch.inference_mode():
        handed, out, tiles = up(many), mlp(many), mlp(few)
        composed = down(silu_and_mul(handed))
        up.keeps_bf16 = False
        cast_up, cast, cast_tiles = up(many), mlp(many), mlp(few)
        # a bf16 input on the tiles' rows (never from `quantize`'s pairs) still answers in float32
        few_bf16 = down(silu_and_mul(up(few)).bfloat16())
    assert handed.dtype == torch.bfloat16 and cast_up.dtype == torch.float32
    assert torch.equal(cast_up, handed.float())  # the same GEMM, cast or not
    assert torch.equal(out, composed) and out.dtype == cast.dtype == few_bf16.dtype == torch.float32
    assert torch.equal(tiles, cast_tiles)
    w_up, w_down = up._dequantized(torch.float64), down._dequantized(torch.float64)
    g, u = (many.double() @ w_up.T).chunk(2, dim=-1)
    ref = (F.silu(g) * u) @ w_down.T
    for got in (out, cast):
        assert (got.double() - ref).abs().max().item() < 3e-2 * ref.abs().max().item()


def test_norms_write_an_int4_bf16_gemms_input_in_bf16_to_the_same_bits(
    native, tiny_llama, make_context, monkeypatch
):
    """Where a prefill step's rows take int4's bf16 GEMM (AMX forced here), the norms before the
    q|k|v and gate|up projections write their result in bf16, the cast those projections made, and
    the o and down projections hand theirs on in bf16 for the next norm to widen: the hidden states
    and the cache are the same bits as with every projection casting to and from the float32 stream.
    Decode rows (the tiles) keep float32 throughout."""
    import copy

    from tokenops.engine.kv_cache import allocate_kv_caches
    from tokenops.engine.models.llama import LlamaDecoderLayer
    from tokenops.engine.quantize import int4, quantize_model

    monkeypatch.setattr(int4, "has_bf16_tiles", lambda device: True)
    monkeypatch.setattr(int4, "bf16_gemm_min_rows", lambda: 12)
    monkeypatch.setattr(LlamaDecoderLayer, "one_call", False)
    model = copy.deepcopy(tiny_llama.model)
    quantize_model(model, "int4")
    if not model.model.layers[0].mlp.gate_up_proj.native:
        pytest.skip("int4 keeps the tiles only where the block kernels run")
    seen: list[tuple[str, torch.dtype]] = []
    shipped_input_dtype = Int4WeightOnlyLinear.input_dtype
    handing: list[torch.dtype] = []  # what the o and down projections return
    outputs = [m for name, m in model.named_modules() if name.endswith(("o_proj", "down_proj"))]
    assert outputs and all(m.keeps_bf16 for m in outputs)
    for name, m in model.named_modules():
        if name.endswith(("qkv_proj", "gate_up_proj")):  # the layers call .forward, past any hooks

            def spied(x, name=name, forward=m.forward):
                seen.append((name, x.dtype))
                return forward(x)

            m.forward = spied
            if name.endswith("gate_up_proj"):  # rows on the tiles take the projection and SiLU in one

                def spied_one_pass(x, name=name, one_pass=m.forward_silu_mul):
                    out = one_pass(x)
                    if out is not None:  # None: the MLP calls .forward next, which records it
                        seen.append((name, x.dtype))
                    return out

                m.forward_silu_mul = spied_one_pass
        elif m in outputs:

            def returned(x, forward=m.forward):
                out = forward(x)
                handing.append(out.dtype)
                return out

            m.forward = returned

    def run(norm_writes_bf16: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setattr(
            Int4WeightOnlyLinear,
            "input_dtype",
            shipped_input_dtype if norm_writes_bf16 else (lambda self, x: x.dtype),
        )
        for m in outputs:
            m.keeps_bf16 = norm_writes_bf16
        cfg = model.config
        caches = allocate_kv_caches(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        prefill = make_context(cfg, [5, 9, 2], [5, 9, 2], kv_caches=caches)
        decode = make_context(cfg, [1, 1, 1], [6, 10, 3], kv_caches=caches)
        g = torch.Generator().manual_seed(5)
        with torch.inference_mode():
            hidden = [
                model(torch.randint(0, cfg.vocab_size, (n,), generator=g), ctx)
                for ctx, n in ((prefill, 16), (decode, 3))
            ]
        return hidden, [t.clone() for kv in caches for t in kv]

    ours, ours_cache = run(True)
    steps = 2 * len(model.model.layers)  # q|k|v and gate|up per layer
    assert [d for _, d in seen[:steps]] == [torch.bfloat16] * steps  # the prefill's 16 rows
    assert [d for _, d in seen[steps:]] == [torch.float32] * steps  # the decode's 3 rows: the tiles
    assert handing == [torch.bfloat16] * steps + [torch.float32] * steps
    seen.clear()
    handing.clear()
    ref, ref_cache = run(False)
    assert [d for _, d in seen] == handing == [torch.float32] * (2 * steps)
    for a, b in zip(ours + ours_cache, ref + ref_cache, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 15, 63, 64, 65, 300])
def test_bf16_gemm_rows_go_in_buckets_and_the_rows_given_come_back(monkeypatch, rows):
    """oneDNN builds a primitive per row count, so from GEMM_ROW_BUCKET_FROM rows the int4 layer's
    bf16 GEMM sees row counts in buckets of GEMM_ROW_BUCKET (zero rows appended), and it hands back
    exactly the rows it was given."""
    from tokenops.engine.models import layers
    from tokenops.engine.quantize import int4

    monkeypatch.setattr(int4, "block_kernels", lambda device: True)
    monkeypatch.setattr(int4, "has_bf16_tiles", lambda device: True)
    monkeypatch.setattr(int4, "bf16_gemm_min_rows", lambda: 1)
    seen = []
    linear = F.linear
    monkeypatch.setattr(int4.F, "linear", lambda x, w: seen.append(x.shape) or linear(x, w))
    torch.manual_seed(rows)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(96, 40, bias=False), 32)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = layer(x)
    bucket = layers.GEMM_ROW_BUCKET
    assert seen == [(rows if rows < layers.GEMM_ROW_BUCKET_FROM else -(-rows // bucket) * bucket, 96)]
    assert out.shape == (rows, 40) and out.dtype == torch.float32 and out.is_contiguous()
    w = layer._dequantized(torch.float32).bfloat16()
    ref = (x.bfloat16().double() @ w.double().T).bfloat16().float()  # each output rounded once
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-2)
    padded = layers.bucket_rows(x, torch.bfloat16)
    assert padded.shape == (seen[0][0], 96) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:rows], x.bfloat16()) and not padded[rows:].any()
