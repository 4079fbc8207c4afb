"""The native small-row matmuls (kernels/csrc/gemv.cpp): bf16 and int8 weights, float32 activations,
against float64 math on the same (dequantised) weights, for odd shapes, 1..19 rows, bias or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# (out, in): up to 8 rows the kernels step through a row 64 bytes at a time (32 bf16 / 64 int8) and
# finish it 16 at a time, masked: `in` below, at and past 32 / 64 / 128 with every tail length class;
# more rows, or activations past 16 KB (1536 inputs from 3 rows; one row always streams), take blocks
# of 4 weight rows, so `out` not a multiple of 4 too
SHAPES = [
    (1, 1),
    (7, 15),
    (5, 17),
    (3, 31),
    (4, 32),
    (6, 33),
    (9, 63),
    (2, 64),
    (11, 65),
    (33, 100),
    (5, 127),
    (3, 129),
    (96, 576),
    (130, 1536),
    (3, 4133),
]


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    # float32 sums of `in` products: error grows with the dot's magnitude, ~sqrt(in) * 2^-24 each
    return 1e-5 * (x.abs().double() @ w.abs().double().t()).max().item() + 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_equals_float64_reference(native, rows, shape, bias):
    out_f, in_f = shape
    torch.manual_seed(rows * 1000 + in_f)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f).bfloat16()
    b = torch.randn(out_f) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = native.linear_bf16(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    assert (y.double() - ref).abs().max().item() <= _tolerance(x, w.float())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_int8_equals_float64_reference(native, rows, shape, bias):
    out_f, in_f = shape
    torch.manual_seed(rows * 1000 + in_f)
    x = torch.randn(rows, in_f)
    q = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)
    s = torch.rand(out_f) * 0.01
    b = torch.randn(out_f) if bias else None
    w = q.double() * s.double()[:, None]
    ref = F.linear(x.double(), w, None if b is None else b.double())
    y = native.linear_int8(x, q, s, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    assert (y.double() - ref).abs().max().item() <= _tolerance(x, w.float())


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_results_do_not_depend_on_the_thread_count(native, rows):
    # each output is one thread's sum in a fixed order: 1 or 2 threads give the same bits
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576), torch.randn(3000, 576)
    wb, q, s = w.bfloat16(), (w * 40).clamp(-128, 127).to(torch.int8), torch.rand(3000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear_bf16(x, wb, None), native.linear_int8(x, q, s, None)
        torch.set_num_threads(2)
        two = native.linear_bf16(x, wb, None), native.linear_int8(x, q, s, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("in_f", [37, 100, 576, 1536])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_rows_result_does_not_depend_on_the_row_count(native, in_f, dtype):
    """Row 0's output is the same bits whether it is alone or shares the call with up to 32 rows
    (row loop, block loop, the 16 KB switch between them): a request's greedy tokens must not
    change with how many requests decode beside it."""
    torch.manual_seed(in_f)
    x = torch.randn(32, in_f)
    if dtype == "bf16":
        w = torch.randn(24, in_f).bfloat16()
        call = lambda rows: native.linear_bf16(x[:rows].contiguous(), w, None)  # noqa: E731
    else:
        w, scales = torch.randint(-127, 128, (24, in_f), dtype=torch.int8), torch.rand(24) * 0.01
        call = lambda rows: native.linear_int8(x[:rows].contiguous(), w, scales, None)  # noqa: E731
    alone = call(1)[0]
    for rows in (2, 3, 4, 5, 8, 9, 12, 16, 32):
        assert torch.equal(call(rows)[0], alone), f"{rows} rows changed row 0's result"


def test_leading_dimensions_are_kept(native):
    x, w = torch.randn(2, 3, 40), torch.randn(9, 40).bfloat16()
    y = native.linear_bf16(x, w, None)
    assert y.shape == (2, 3, 9)
    torch.testing.assert_close(y, F.linear(x, w.float()))
    assert native.linear_bf16(torch.randn(0, 40), w, None).shape == (0, 9)


def test_bad_inputs_are_refused(native):
    w = torch.randn(8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="contiguous"):
        native.linear_bf16(torch.randn(32, 4).t(), w, None)  # a strided view
    with pytest.raises(RuntimeError, match="float32"):
        native.linear_bf16(torch.randn(4, 32).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="does not match"):
        native.linear_bf16(torch.randn(4, 31), w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.linear_bf16(torch.randn(4, 32), w.float(), None)
    with pytest.raises(RuntimeError, match="bias"):
        native.linear_bf16(torch.randn(4, 32), w, torch.randn(7))
    with pytest.raises(RuntimeError, match="contiguous"):
        native.linear_bf16(torch.randn(4, 32), torch.randn(32, 8).bfloat16().t(), None)
    q = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="scales"):
        native.linear_int8(torch.randn(1, 32), q, torch.ones(7), None)
    with pytest.raises(RuntimeError, match="int8"):
        native.linear_int8(torch.randn(1, 32), q.to(torch.uint8), torch.ones(8), None)
