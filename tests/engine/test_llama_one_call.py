"""Llama decoder layers with int4 tile weights as native calls (`tokenops::llama_layers_q4`,
models/llama.py's `_one_call_run`): a step's consecutive such layers in one call, or one call per
layer, against the same layers op by op: the same bits, in the hidden states and in the KV cache
(float32 or int8), over a prefill step and a decode step."""

import copy
import dataclasses

import pytest
import torch

from tokenops.engine import kernels
from tokenops.engine.kv_cache import QuantizedKV, allocate_kv_caches
from tokenops.engine.models import llama as llama_module
from tokenops.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenops.engine.quantize import quantize_model
from tokenops.engine.quantize.common import block_kernels

ONE_CALL_PARTS = LlamaDecoderLayer._one_call_parts


@pytest.fixture
def int4_llama(tiny_llama):
    if kernels.ops("cpu") is None or not block_kernels("cpu"):
        pytest.skip("the one-call layer runs where int4 layers take the native block kernels")
    model = copy.deepcopy(tiny_llama.model)
    # four layers, so that a run holds more than two
    for _ in range(2):
        layer = copy.deepcopy(model.model.layers[-1])
        layer.self_attn.layer_idx = len(model.model.layers)
        model.model.layers.append(layer)
    model.config = dataclasses.replace(model.config, num_layers=len(model.model.layers))
    quantize_model(model, "int4")
    return model


def _snapshot(cache) -> tuple[torch.Tensor, ...]:
    return (cache.data.clone(), cache.scale.clone()) if isinstance(cache, QuantizedKV) else (cache.clone(),)


def _steps(
    model, make_context, monkeypatch, one_call: bool, kv_dtype: torch.dtype = torch.float32, runs: bool = True
) -> tuple[list[torch.Tensor], list, list[bool]]:
    """Three prompts of 5, 9 and 2 tokens, then one decode token each: the hidden states of both
    steps, the KV cache after them, and whether each layer's one-call check found it could take the
    one-call path (`runs`: consecutive such layers in one call)."""
    monkeypatch.setattr(LlamaDecoderLayer, "one_call", one_call)
    monkeypatch.setattr(LlamaForCausalLM, "one_call_runs", runs)
    taken: list[bool] = []
    parts = ONE_CALL_PARTS  # not the attribute: a second call here would wrap the first's wrapper

    def counted(self, *args):
        out = parts(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(LlamaDecoderLayer, "_one_call_parts", counted)
    calls = {"llama_layers_q4": 0}
    native = kernels.ops("cpu")

    class Counted:  # the native ops, counting the one-call op's calls
        def __getattr__(self, name):
            op = getattr(native, name)
            if name not in calls:
                return op

            def call(*args):
                calls[name] += 1
                return op(*args)

            return call

    if native is not None:
        monkeypatch.setattr(llama_module, "native_ops", lambda *a: Counted())
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    cfg = model.config
    caches = allocate_kv_caches(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    prefill = make_context(cfg, [5, 9, 2], [5, 9, 2], kv_caches=caches)
    decode = make_context(model.config, [1, 1, 1], [6, 10, 3], kv_caches=prefill.kv_caches)
    hidden = []
    with torch.inference_mode():
        for ctx, n in ((prefill, 16), (decode, 3)):
            hidden.append(model(torch.randint(0, vocab, (n,), generator=g), ctx))
    _steps.calls = calls
    return hidden, [tuple(_snapshot(c) for c in kv) for kv in prefill.kv_caches], taken


@pytest.mark.parametrize("runs", [True, False], ids=["layers_in_one_call", "a_call_per_layer"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["kv_float32", "kv_int8"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "qkv_bias"])
def test_one_call_layers_equal_the_op_by_op_layers_to_the_bit(
    int4_llama, make_context, monkeypatch, bias, kv_dtype, runs
):
    if bias:  # Qwen2-style q|k|v bias, which the one call passes through as the int4 layer does
        for layer in int4_llama.model.layers:
            qkv = layer.self_attn.qkv_proj
            qkv.bias = torch.randn(qkv.out_features, generator=torch.Generator().manual_seed(9))
    ours, caches, taken = _steps(int4_llama, make_context, monkeypatch, True, kv_dtype, runs)
    calls = dict(_steps.calls)
    ref, ref_caches, ref_taken = _steps(int4_llama, make_context, monkeypatch, False, kv_dtype)
    # every layer takes the one call in both steps, the first over a zero stream it starts there; all
    # of them in one call per step with `runs` (the tiny model has more than two layers)
    layers = len(int4_llama.model.layers)
    assert layers > 2
    assert taken == [True] * (2 * layers) and ref_taken == [False] * (2 * layers)
    assert calls == {"llama_layers_q4": 2 if runs else 2 * layers}
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
    for layer, ref_layer in zip(caches, ref_caches, strict=True):
        for ours_t, ref_t in zip(sum(layer, ()), sum(ref_layer, ()), strict=True):
            assert torch.equal(ours_t, ref_t)


def test_other_layers_stay_op_by_op(tiny_llama, make_context, monkeypatch):
    """Float32 weights (or any projection not on the int4 tiles) never take the one call."""
    model = copy.deepcopy(tiny_llama.model)
    _, _, taken = _steps(model, make_context, monkeypatch, one_call=True)
    assert taken and not any(taken)


def test_one_call_weights_follow_a_replaced_weight(int4_llama, make_context, monkeypatch):
    """The layer's cached argument list is rebuilt when a projection's buffers are replaced (a load):
    the one call then reads the new weights, as the op-by-op path does."""
    _steps(int4_llama, make_context, monkeypatch, one_call=True)
    for layer in int4_llama.model.layers:
        down = layer.mlp.down_proj
        down.scales_and_zeros = down.scales_and_zeros * 2
    ours, _, taken = _steps(int4_llama, make_context, monkeypatch, one_call=True)
    ref, _, _ = _steps(int4_llama, make_context, monkeypatch, one_call=False)
    assert any(taken)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
