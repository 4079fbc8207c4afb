"""The native CPU kernels (tokenops.engine.kernels): they build here, and each equals its PyTorch path."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenops.engine import kernels
from tokenops.engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "enabled", False)
    assert kernels.ops() is None


def test_not_used_off_cpu():
    assert kernels.ops("meta") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_equals_module(native, dtype, unit_offset, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-6, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, 96, dtype=dtype) * 3
    residual = torch.randn(rows, 96, dtype=dtype)
    summed = x + residual
    with torch.inference_mode():
        expected, expected_after_add = norm._torch_forward(x), norm._torch_forward(summed)
        got = native.rms_norm(x, None, norm.weight, norm.eps, unit_offset)
        got_after_add = native.rms_norm(x, residual, norm.weight, norm.eps, unit_offset)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(got_after_add, expected_after_add, **tol)
    assert torch.equal(residual, summed)  # the residual holds the sum afterwards, as the layers expect


def test_rms_norm_refuses_mismatched_weight(native):
    with pytest.raises(RuntimeError, match="weight must have"):
        native.rms_norm(torch.randn(2, 8), None, torch.ones(4), 1e-6, False)


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def test_rms_norm_forward_add_matches_torch_path(native, monkeypatch):
    norm = RMSNorm(32, 1e-6)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    with torch.inference_mode():
        got, got_sum = norm.forward_add(x, residual.clone())
        monkeypatch.setattr(kernels, "enabled", False)
        expected, expected_sum = norm.forward_add(x, residual)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_sum, expected_sum)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_to_is_the_float32_norm_then_a_cast_to_the_bit(native, x_dtype, out_dtype, unit_offset):
    """A bf16 sublayer output added to a float32 stream, and a result written in bf16, are the same
    bits as widening x, norming in float32 and casting the result."""
    torch.manual_seed(3)
    norm = RMSNorm(96, 1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = (torch.randn(37, 96) * 3).to(x_dtype), torch.randn(37, 96)
    with torch.inference_mode():
        ref_sum, got_sum = residual.clone(), residual.clone()
        ref = native.rms_norm(x.float(), ref_sum, norm.weight, norm.eps, unit_offset).to(out_dtype)
        got = native.rms_norm_to(x, got_sum, norm.weight, norm.eps, unit_offset, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, ref) and torch.equal(got_sum, ref_sum)
        if x_dtype == torch.float32:
            alone = native.rms_norm_to(x, None, norm.weight, norm.eps, unit_offset, out_dtype)
            assert torch.equal(
                alone, native.rms_norm(x, None, norm.weight, norm.eps, unit_offset).to(out_dtype)
            )
        # the module's forms, native and PyTorch, agree on dtype and (within the sum's order) on values
        native_out, native_sum = norm.forward_add(x, residual.clone(), out_dtype)
        torch.testing.assert_close(native_sum, ref_sum)
        assert torch.equal(native_out, ref)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "enabled", False)
        torch_out, torch_sum = norm.forward_add(x, residual.clone(), out_dtype)
    assert torch_out.dtype == out_dtype and torch_sum.dtype == torch.float32
    torch.testing.assert_close(torch_sum, ref_sum)
    torch.testing.assert_close(torch_out.float(), ref.float(), **_tol(out_dtype))


def test_rms_norm_to_refuses_what_it_does_not_compute(native):
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="bf16 with a residual"):
        native.rms_norm_to(torch.randn(2, 8).bfloat16(), None, w, 1e-6, False, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        native.rms_norm_to(torch.randn(2, 8), None, w, 1e-6, False, torch.float16)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        native.rms_norm_to(torch.randn(2, 8), None, w.bfloat16(), 1e-6, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="residual must be"):
        native.rms_norm_to(
            torch.randn(2, 8).bfloat16(), torch.randn(2, 8).bfloat16(), w, 1e-6, False, torch.float32
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9])
def test_rotary_equals_apply_rotary_on_qkv_views(native, dtype, rows):
    heads, kv_heads, d = 6, 2, 64
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)  # row-strided views, as the models pass them
    positions = torch.tensor([0, 1, 17, 4095, 100_000, 7, 8, 9, 3][:rows])
    inv_freq = rope_inv_freq(d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat((t, t), dim=-1).to(dtype)[:, None, :] for t in (freqs.cos(), freqs.sin()))
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * d :].clone()
    native.rotary_(q, k, freqs.cos(), freqs.sin())
    torch.testing.assert_close(q, expected_q, **_tol(dtype))
    torch.testing.assert_close(k, expected_k, **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], untouched)  # v, beside them, is not written


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_rotary_store_kv_equals_rotary_then_write_kv(native, dtype, cache_dtype, rows):
    """The fused prologue leaves the same bits in q and in the cache as rotary_ then write_kv."""
    from tokenops.engine.kv_cache import write_kv

    heads, kv_heads, d, blocks, bs = 6, 2, 64, 40, 16
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
    slots = torch.randperm(blocks * bs)[:rows]
    freqs = torch.randint(0, 5000, (rows,)).float()[:, None] * rope_inv_freq(d, 10000.0)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    k_cache, v_cache = (torch.randn(blocks, bs, kv_heads, d).to(cache_dtype) for _ in range(2))
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = ref_qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)
    native.rotary_(q, k, cos, sin)
    write_kv(k, v.view(rows, kv_heads, d), ref_k, ref_v, slots)

    native.rotary_store_kv_(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    assert torch.equal(qkv[:, : heads * d], ref_qkv[:, : heads * d])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_rotary_store_kv_quantises_into_an_int8_cache(native, dtype, rows):
    """Into an int8 cache the fused prologue writes the codes and float16 scales write_kv's
    quantisation writes after rotary_, and leaves the same rotated queries."""
    from tokenops.engine.kv_cache import allocate_layer, write_kv

    heads, kv_heads, d, blocks, bs = 6, 2, 64, 40, 16
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype) * 3
    slots = torch.randperm(blocks * bs)[:rows]
    freqs = torch.randint(0, 5000, (rows,)).float()[:, None] * rope_inv_freq(d, 10000.0)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    shape = (blocks, bs, kv_heads, d)
    k_cache, v_cache, ref_k, ref_v = (allocate_layer(shape, torch.int8, "cpu") for _ in range(4))
    ref_qkv = qkv.clone()
    q, k, v = ref_qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)
    native.rotary_(q, k, cos, sin)
    write_kv(k, v.view(rows, kv_heads, d), ref_k, ref_v, slots)  # grad mode on: PyTorch's quantisation

    native.rotary_store_kv_(
        qkv, cos, sin, k_cache.data, v_cache.data, slots, heads, kv_heads, k_cache.scale, v_cache.scale
    )
    assert torch.equal(qkv[:, : heads * d], ref_qkv[:, : heads * d])
    for ours, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        assert torch.equal(ours.data, ref.data) and torch.equal(ours.scale, ref.scale)
    assert ref_k.scale.view(-1, kv_heads)[slots].gt(0).all()  # the slots were written


def test_rotary_store_kv_refuses_bad_slots_and_shapes(native):
    qkv, cos = torch.randn(2, 10 * 16), torch.zeros(2, 8)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(RuntimeError, match="out of the cache's range"):
        native.rotary_store_kv_(qkv, cos, cos, k_cache, v_cache, torch.tensor([0, 16]), 6, 2)
    with pytest.raises(RuntimeError, match="qkv must be"):
        native.rotary_store_kv_(qkv, cos, cos, k_cache, v_cache, torch.tensor([0, 1]), 5, 2)
    with pytest.raises(RuntimeError, match="caches must be"):
        native.rotary_store_kv_(qkv, cos, cos, k_cache, v_cache.double(), torch.tensor([0, 1]), 6, 2)
    codes, scale = torch.zeros(4, 4, 2, 16, dtype=torch.int8), torch.zeros(4, 4, 2, 1, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="int8 cache takes k_scale and v_scale"):
        native.rotary_store_kv_(qkv, cos, cos, codes, codes.clone(), torch.tensor([0, 1]), 6, 2)
    with pytest.raises(RuntimeError, match="a float cache neither"):
        native.rotary_store_kv_(qkv, cos, cos, k_cache, v_cache, torch.tensor([0, 1]), 6, 2, scale, scale)
    with pytest.raises(RuntimeError, match="scales must be"):
        native.rotary_store_kv_(
            qkv, cos, cos, codes, codes.clone(), torch.tensor([0, 1]), 6, 2, scale.float(), scale
        )


def test_rope_native_and_torch_paths_agree(native, monkeypatch):
    rotary = RotaryEmbedding(rope_inv_freq(16, 10000.0))
    positions = torch.tensor([3, 40, 41])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with torch.inference_mode():
        got_q, got_k = rotary(positions, torch.float32)(q.clone(), k.clone())
        monkeypatch.setattr(kernels, "enabled", False)
        expected_q, expected_k = rotary(positions, torch.float32)(q, k)
    torch.testing.assert_close(got_q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, expected_k, atol=1e-6, rtol=1e-6)


def test_rotary_refuses_non_dense_heads(native):
    q = torch.randn(2, 16, 4).transpose(1, 2)  # [2, 4, 16] with strided head_dim
    with pytest.raises(RuntimeError, match="must be contiguous"):
        native.rotary_(q, torch.randn(2, 2, 16), torch.zeros(2, 8), torch.zeros(2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 100), (2, 3, 2 * 40)])
@pytest.mark.parametrize(
    ("op", "act"),
    [("silu_mul", F.silu), ("gelu_tanh_mul", lambda g: F.gelu(g, approximate="tanh"))],
)
def test_gated_activations_equal_torch(native, dtype, shape, op, act):
    torch.manual_seed(shape[-1])
    x = torch.randn(*shape) * 4
    x[..., :4] = torch.tensor([-100.0, 100.0, 0.0, -9.0])  # the exp clamp, zero, a deep negative tail
    x = x.to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(getattr(native, op)(x), act(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
def test_gated_activations_give_the_same_bits_in_every_lane_width(native, op, dtype):
    """A row's first elements run 8 or 16 lanes at a time, its tail one at a time: the same value
    gives the same bits wherever it sits, NaN stays NaN, the clamp's ends hold, and bf16 results
    that are subnormal stay subnormal (a vectorised bf16 conversion such as vcvtneps2bf16 would
    flush them)."""
    torch.manual_seed(3)
    values = torch.cat(
        [
            torch.randn(61) * 6,
            torch.tensor([-100.0, 100.0, 0.0, -0.0, 87.5, -88.5, 1e-39, -3e-39, float("nan")]),
        ]
    ).to(dtype)
    width = values.numel()
    ones = torch.ones(width, dtype=dtype)
    wide = getattr(native, op)(torch.cat([values, ones]).unsqueeze(0))[0]
    one_at_a_time = getattr(native, op)(torch.stack([values, ones], dim=1))[:, 0]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(wide.view(bits), one_at_a_time.view(bits))
    assert wide[-1].isnan() and not wide[:-1].isnan().any()
    if dtype == torch.bfloat16:  # x * sigmoid(x) of a tiny x is about x / 2: subnormal, not zero
        assert (wide[-3:-1] != 0).all()


def test_gated_activation_refuses_odd_width(native):
    with pytest.raises(RuntimeError, match=r"gate \| up"):
        native.silu_mul(torch.randn(2, 5))


def test_stale_build_lock_does_not_block_a_start(native, tmp_path):
    """A build killed mid-way leaves torch's lock file behind; a later start loads the built library
    without waiting on it (before, it waited forever)."""
    import subprocess
    import sys

    from tokenops.modelfiles.files import default_cache_dir

    key = kernels._build_key(sorted(kernels.CSRC.glob("*.cpp")))
    built = default_cache_dir() / "kernels" / key
    assert (built / f"tokenops_kernels_{key}.so").is_file()
    copy = tmp_path / "kernels" / key
    shutil.copytree(built, copy)
    (copy / "lock").write_text("")
    probe = "from tokenops.engine import kernels; assert kernels.ops() is not None, kernels.build_error()"
    env = {**os.environ, "TOKENOPS_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
