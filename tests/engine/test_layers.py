"""Shape-dependent linear kernels: every path gives F.linear's result and follows weight changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tokenops.engine.models.layers import (
    Linear,
    MergedLinear,
    VocabProjection,
    onednn_linear_available,
    use_derived_weights,
)

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_for_every_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), **TOL)


def test_prepacked_weight_follows_in_place_loads_and_dtype_moves() -> None:
    lin = MergedLinear(16, [8, 8])
    x = torch.randn(4, 16)
    with torch.inference_mode():
        lin(x)  # builds the packed copy of the current weight
    lin.load_shard(1, torch.full((8, 16), 0.5))  # an in-place write after the first use
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)
        lin.to(torch.bfloat16)
        xb = x.bfloat16()
        torch.testing.assert_close(lin(xb), F.linear(xb, lin.weight))


def test_a_model_with_prepacked_weights_can_be_deep_copied() -> None:
    lin = Linear(16, 16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        before = lin(x)
    twin = copy.deepcopy(lin)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), before)


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_vocab_projection_matches_f_linear_and_follows_the_weight(rows: int) -> None:
    weight = torch.randn(1000, 32)
    hidden = torch.randn(rows, 32)
    head = VocabProjection()
    with torch.inference_mode():
        torch.testing.assert_close(head(hidden, weight), F.linear(hidden, weight), **TOL)
        weight.mul_(-2.0)  # e.g. a tied embedding reloaded in place
        torch.testing.assert_close(head(hidden, weight), F.linear(hidden, weight), **TOL)


def test_onednn_probe_answers_on_cpu() -> None:
    # the probe must not raise; where oneDNN is missing the layers fall back to F.linear
    assert onednn_linear_available() in (True, False)


def test_derived_weights_can_be_switched_off_and_their_memory_is_dropped() -> None:
    model = torch.nn.Module()
    model.proj = Linear(16, 24)
    model.vocab_projection = VocabProjection()
    head = torch.randn(40, 16)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        expected, logits = model.proj(x), model.vocab_projection(x, head)
    built = [model.proj._packed.value, model.vocab_projection._packed.value]
    assert onednn_linear_available() == all(v is not None for v in built)
    use_derived_weights(model, False)
    assert model.proj._packed.value is None and model.vocab_projection._packed.value is None
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), expected, **TOL)
        torch.testing.assert_close(model.vocab_projection(x, head), logits, **TOL)
        model.vocab_projection(x[:1], head)
    # nothing was rebuilt while switched off
    assert model.proj._packed.value is None and model.vocab_projection._transposed.value is None
