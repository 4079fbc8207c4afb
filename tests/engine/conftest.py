"""Shared engine fixtures: tiny random models with a Hugging Face reference.

`tiny_llama` / `tiny_gemma3` build a small random HF config, an HF reference model (transformers,
test-only) and our model loaded from the reference's state dict, so any test can compare our
logits or greedy tokens with HF's. The bundled-model fixtures live in tests/conftest.py, since the
tokenizer tests of tests/modelfiles use them too.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch

from tokenops.engine import kernels
from tokenops.engine.context import ForwardContext, allocate_kv_caches, build_context
from tokenops.engine.kv_cache import QuantizedKV
from tokenops.engine.models import CausalLM, ModelConfig, build_model


@dataclass
class TinyModel:
    """A random-weight model pair: `hf` (transformers) and `model` (ours), same weights, float32."""

    hf: torch.nn.Module
    model: CausalLM
    config: ModelConfig
    hf_config: object


def make_context(
    config: ModelConfig,
    query_lens: list[int],
    context_lens: list[int],
    block_size: int = 4,
    num_blocks: int = 64,
    kv_caches: list | None = None,
    block_tables: list[list[int]] | None = None,
) -> ForwardContext:
    """A ForwardContext for a test: sequence s gets consecutive blocks unless `block_tables` is given."""
    if kv_caches is None:
        kv_caches = allocate_kv_caches(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, torch.float32
        )
    if block_tables is None:
        block_tables, nxt = [], 0
        for n in context_lens:
            need = -(-n // block_size)
            block_tables.append(list(range(nxt, nxt + need)))
            nxt += need
    return build_context(query_lens, context_lens, block_tables, block_size, kv_caches)


def random_kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    g: torch.Generator) -> list:
    """One layer's (keys, values) cache filled with random entries (int8: random codes and scales), for
    the paged attention kernels' parity tests."""
    caches = allocate_kv_caches(1, num_blocks, block_size, kv_heads, head_dim, dtype)
    for cache in caches[0]:
        if isinstance(cache, QuantizedKV):
            cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=g, dtype=torch.int8))
            cache.scale.copy_(torch.rand(cache.scale.shape, generator=g) * 0.05 + 1e-3)
        else:
            cache.copy_(torch.randn(cache.shape, generator=g))
    return caches


def prompt_logits(model, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in one step through the paged cache."""
    c = model.config
    n, blocks = len(ids), -(-len(ids) // block_size)
    caches = allocate_kv_caches(c.num_layers, blocks, block_size, c.num_kv_heads, c.head_dim, torch.float32)
    ctx = build_context([n], [n], [list(range(blocks))], block_size, caches)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), ctx))


@pytest.fixture(scope="session")
def native():
    """torch.ops.tokenops: the native CPU kernels, built here (skipped only where no C++ compiler exists)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine runs on its PyTorch paths")
    ops = kernels.ops()
    assert ops is not None, f"native kernels failed to build: {kernels.build_error()}"
    return ops


@pytest.fixture(name="make_context")
def make_context_fixture():
    """The `make_context` helper as a fixture (test modules cannot import conftest)."""
    return make_context


def _ours_from_hf(hf: torch.nn.Module) -> tuple[CausalLM, ModelConfig]:
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(config, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    return model, config


@pytest.fixture(scope="session")
def tiny_llama() -> TinyModel:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(hf_config).float().eval()
    # HF init leaves RMSNorm weights at 1; randomise them so a wrong norm path cannot hide
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model, config = _ours_from_hf(hf)
    return TinyModel(hf=hf, model=model, config=config, hf_config=hf_config)


@pytest.fixture(scope="session")
def tiny_gemma3() -> TinyModel:
    """Two layers (sliding, then global) with a 5-token window, so 20-token prompts exercise it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf_config = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=24,  # differs from head_dim so a wrong scale shows
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation="eager",
    )
    hf = transformers.Gemma3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # Gemma norms are offsets from 1: HF inits them to 0
                p.uniform_(-0.5, 0.5)
    model, config = _ours_from_hf(hf)
    return TinyModel(hf=hf, model=model, config=config, hf_config=hf_config)
