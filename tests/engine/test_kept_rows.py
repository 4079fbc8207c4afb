"""A step's last layer computes only the rows it samples (`CausalLM.forward(rows=...)`): those rows'
hidden states equal the full forward's, and every row's K and V still reach the cache, for each
family and weight format; the engine's runner asks for it on prefill chunks."""

import copy

import pytest
import torch

from tokenops.engine.kv_cache import QuantizedKV, allocate_kv_caches
from tokenops.engine.model_runner import ModelRunner
from tokenops.engine.quantize import quantize_model
from tokenops.engine.sampling_rows import SamplingRows

# three prompts of 5, 9 and 2 tokens: the first and last sample their last token, the middle one is a
# prefill chunk that stops mid-prompt and samples nothing
LENS = [5, 9, 2]
ROWS = [4, 15]


def _forward(model, make_context, rows, kv_dtype=torch.float32):
    cfg = model.config
    caches = allocate_kv_caches(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    ctx = make_context(cfg, LENS, LENS, kv_caches=caches)
    ids = torch.randint(3, cfg.vocab_size, (sum(LENS),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        hidden = model(ids, ctx, rows=None if rows is None else torch.tensor(rows, dtype=torch.long))
    cache = [
        torch.cat([t.data.flatten().float(), t.scale.flatten()]) if isinstance(t, QuantizedKV) else t
        for layer in caches
        for t in layer
    ]
    return hidden, cache


def _check(model, make_context, kv_dtype=torch.float32, exact=True):
    full, full_cache = _forward(model, make_context, None, kv_dtype)
    kept, kept_cache = _forward(model, make_context, ROWS, kv_dtype)
    assert kept.shape == (len(ROWS), model.config.hidden_size)
    if exact:
        assert torch.equal(kept, full[ROWS])
    else:  # float32 GEMMs may sum in another order for fewer rows
        torch.testing.assert_close(kept, full[ROWS], rtol=1e-5, atol=1e-5)
    for a, b in zip(kept_cache, full_cache, strict=True):
        assert torch.equal(a, b)
    # no row sampled (every prompt stops mid-way): K and V still stored, no hidden rows out
    none, none_cache = _forward(model, make_context, [], kv_dtype)
    assert none.shape == (0, model.config.hidden_size)
    for a, b in zip(none_cache, full_cache, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
def test_dense_families_keep_the_sampled_rows(family, request, make_context):
    _check(request.getfixturevalue(family).model, make_context, exact=False)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["kv_float32", "kv_int8"])
def test_int4_llama_keeps_the_sampled_rows_to_the_bit(tiny_llama, make_context, kv_dtype):
    """The int4 kernels quantise each row's activations on their own: a kept row ignores the others."""
    model = copy.deepcopy(tiny_llama.model)
    quantize_model(model, "int4")
    _check(model, make_context, kv_dtype)


def test_int8_dynamic_llama_keeps_the_sampled_rows(tiny_llama, make_context):
    """fbgemm quantises the row-scaled batch over the batch's own range, so a row's bits depend on
    its batch-mates (with or without kept rows); the kept rows agree to the 8-bit grid."""
    model = copy.deepcopy(tiny_llama.model)
    quantize_model(model, "int8_dynamic")
    full, _ = _forward(model, make_context, None)
    kept, _ = _forward(model, make_context, ROWS)
    torch.testing.assert_close(kept, full[ROWS], rtol=0, atol=0.05)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_families_keep_the_sampled_rows(family, make_tiny_moe, make_context):
    _check(make_tiny_moe(family, seed=3).model, make_context, exact=False)


def test_the_runner_keeps_only_sampling_rows(tiny_llama, make_context, monkeypatch):
    """A prefill chunk asks the model for its sampling rows alone; the logits are the full forward's."""
    model = tiny_llama.model
    forward = type(model).forward
    seen: list[torch.Tensor | None] = []

    def spy(self, ids, ctx, num_layers=None, rows=None):
        seen.append(rows)
        return forward(self, ids, ctx, num_layers, rows)

    runner = ModelRunner(model, 64, 4, torch.float32, "cpu")
    ctx = make_context(model.config, LENS, LENS, kv_caches=runner.kv_caches)
    ctx.logits_indices = torch.tensor(ROWS)
    ids = torch.randint(3, 256, (sum(LENS),), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(type(model), "forward", spy)
    logits = runner.run(ids, ctx, SamplingRows(entries=[0, 2], first_row={0: 0, 2: 1}, plain=[0, 2]))
    monkeypatch.undo()
    assert [r.tolist() for r in seen] == [ROWS]
    with torch.inference_mode():
        full = model.compute_logits(model(ids, make_context(model.config, LENS, LENS))[ROWS])
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
