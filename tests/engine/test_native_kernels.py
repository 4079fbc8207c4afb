"""The native CPU kernels (tokenops.engine.kernels): they build here, and each equals its PyTorch path."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenops.engine import kernels
from tokenops.engine.models.layers import RMSNorm


@pytest.fixture(scope="module")
def native():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine runs on its PyTorch paths")
    ops = kernels.ops()
    assert ops is not None, f"native kernels failed to build: {kernels.build_error()}"
    return ops


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("TOKENOPS_NATIVE_KERNELS", "0")
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
