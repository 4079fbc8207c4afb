"""Shared engine fixtures: forward contexts and KV caches for the kernels' tests, the native ops,
and tiny random MoE models with a Hugging Face reference. The tiny dense models (`tiny_llama`,
`tiny_gemma3`) live in tests/conftest.py, since the cluster's PD tests serve them too."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenops.engine import kernels
from tokenops.engine.context import ForwardContext, build_context
from tokenops.engine.kv_cache import QuantizedKV, allocate_kv_caches
from tokenops.engine.models import ModelConfig, build_model


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


# kDotMinTokens in kernels/csrc/paged_attention.cpp: prefill chunks of at least this many queries over
# a bf16 cache take the kernel's bf16 dot-product path where the build has it
# (`torch.ops.tokenops.prefill_bf16_dot()`); shorter ones keep the exact float32 path
BF16_DOT_MIN_QUERIES = 32


def random_kv_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, g: torch.Generator
) -> list:
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


# ---- tiny MoE models (tests/engine/test_moe_models.py, test_eaas.py) ----

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _hf_configs() -> dict[str, object]:
    return {
        "mixtral": _transformers().MixtralConfig(
            **_COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2
        ),
        # layer 1 dense (mlp_only_layers); a shared expert behind its sigmoid gate; unnormalised top-k
        "qwen2_moe": _transformers().Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
        "qwen3_moe": _transformers().Qwen3MoeConfig(
            **_COMMON,
            head_dim=24,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        "olmoe": _transformers().OlmoeConfig(
            **_COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=4, clip_qkv=0.8
        ),
    }


_HF_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


class TinyMoE:
    """A random-weight MoE pair like `TinyModel`, routing made uneven by larger router and expert weights."""

    def __init__(self, family: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.family = family
        self.hf = getattr(_transformers(), _HF_CLASSES[family])(_hf_configs()[family]).float().eval()
        with torch.no_grad():
            for name, p in self.hf.named_parameters():
                if "norm" in name:  # HF leaves norms at 1: randomise so a wrong norm path cannot hide
                    p.uniform_(0.5, 1.5)
                elif "experts" in name or name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.2)  # larger than init, so routing differs between tokens
        self.config = ModelConfig.from_hf_config(self.hf.config.to_dict())
        self.model = build_model(self.config)
        self.model.load_weights(self.hf.state_dict().items())

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()

    def save(self, folder) -> None:
        """An HF folder: `save_pretrained` (experts as separate tensors) and a byte-level tokenizer.json."""
        from tokenizers import Tokenizer, models, pre_tokenizers

        self.hf.save_pretrained(folder)
        tok = Tokenizer(models.BPE(vocab={chr(i + 33): i for i in range(200)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        (folder / "tokenizer.json").write_text(tok.to_str())

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        return out[0, len(prompt) :].tolist()


def _transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def make_tiny_moe():
    """`make_tiny_moe(family, seed)`: a `TinyMoE` of mixtral, qwen2_moe, qwen3_moe or olmoe."""
    return TinyMoE
