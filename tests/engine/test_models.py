"""Oracle tests of the model families: our logits equal Hugging Face transformers' on the same weights.

Each family is checked on a tiny random config for a full prompt, for a ragged batch of prompts,
and for prefill followed by token-by-token decode through the paged KV cache.
"""

from __future__ import annotations

import pytest
import torch

from tokenops.engine.context import build_context
from tokenops.engine.kv_cache import allocate_kv_caches
from tokenops.engine.models import ModelConfig, build_model

TOL = dict(rtol=1e-4, atol=1e-4)


def hf_logits(tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.hf(torch.tensor([ids])).logits[0].float()


def _ctx(config, query_lens, context_lens, block_size=4, kv_caches=None, block_tables=None):
    if kv_caches is None:
        kv_caches = allocate_kv_caches(
            config.num_layers, 64, block_size, config.num_kv_heads, config.head_dim, torch.float32
        )
    if block_tables is None:
        block_tables, nxt = [], 0
        for n in context_lens:
            need = -(-n // block_size)
            block_tables.append(list(range(nxt, nxt + need)))
            nxt += need
    return build_context(query_lens, context_lens, block_tables, block_size, kv_caches)


def our_logits_full(tiny, ids: list[int], block_size: int = 4) -> torch.Tensor:
    ctx = _ctx(tiny.config, [len(ids)], [len(ids)], block_size=block_size)
    with torch.no_grad():
        return tiny.model.compute_logits(tiny.model(torch.tensor(ids), ctx))


def _prompt(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(params=["tiny_llama", "tiny_gemma3"])
def tiny(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


def test_full_prompt_logits_match_hf(tiny) -> None:
    ids = _prompt(37)
    torch.testing.assert_close(our_logits_full(tiny, ids), hf_logits(tiny, ids), **TOL)


def test_ragged_batch_matches_each_prompt_alone(tiny) -> None:
    prompts = [_prompt(n, seed=n) for n in (5, 1, 19)]
    ids = torch.tensor([t for p in prompts for t in p])
    lens = [len(p) for p in prompts]
    ctx = _ctx(tiny.config, lens, lens, block_size=4)
    with torch.no_grad():
        logits = tiny.model.compute_logits(tiny.model(ids, ctx))
    start = 0
    for p in prompts:
        torch.testing.assert_close(logits[start : start + len(p)], hf_logits(tiny, p), **TOL)
        start += len(p)


def test_prefill_then_decode_matches_hf(tiny) -> None:
    ids = _prompt(20, seed=3)
    ref = hf_logits(tiny, ids)
    cfg = tiny.config
    block_size = 4
    table = [7, 2, 9, 0, 5]  # non-contiguous blocks
    caches = allocate_kv_caches(cfg.num_layers, 16, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    prefix = 13
    ctx = _ctx(cfg, [prefix], [prefix], block_size, kv_caches=caches, block_tables=[table])
    with torch.no_grad():
        out = [tiny.model.compute_logits(tiny.model(torch.tensor(ids[:prefix]), ctx))]
        for pos in range(prefix, len(ids)):
            ctx = _ctx(cfg, [1], [pos + 1], block_size, kv_caches=caches, block_tables=[table])
            out.append(tiny.model.compute_logits(tiny.model(torch.tensor([ids[pos]]), ctx)))
    torch.testing.assert_close(torch.cat(out), ref, **TOL)


def test_config_from_hf_dict_reads_shape(tiny_llama) -> None:
    cfg = tiny_llama.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        2,
        4,
        2,
        16,
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_old_style_rope_scaling_is_read() -> None:
    cfg = ModelConfig.from_hf_config(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta, cfg.num_kv_heads) == ("llama3", 32.0, 500000.0, 2)


def test_missing_and_unknown_weights_are_refused(tiny_llama) -> None:
    model = build_model(tiny_llama.config)
    state = dict(tiny_llama.hf.state_dict())
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights(state.items())
    state = dict(tiny_llama.hf.state_dict())
    state["model.layers.0.mystery.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="does not know"):
        model.load_weights(state.items())


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf_config({"model_type": "mamba"})


def test_gemma3_config_reads_layer_types_and_thetas(tiny_gemma3) -> None:
    cfg = tiny_gemma3.config
    assert cfg.architecture == "gemma3"
    assert cfg.layer_sliding == (True, False) and cfg.sliding_window == 5
    assert (cfg.rope_local_theta, cfg.rope_theta) == (10000.0, 1000000.0)
    assert cfg.attention_scale == 24**-0.5 and cfg.final_logit_softcapping == 30.0


def test_gemma3_sliding_window_changes_logits(tiny_gemma3) -> None:
    """Guard that the parity test really exercises the window: without it the logits differ."""
    ids = _prompt(20, seed=5)
    wide = build_model(tiny_gemma3.config.with_overrides(layer_sliding=(False, False)))
    wide.load_weights(tiny_gemma3.hf.state_dict().items())
    ctx = _ctx(wide.config, [20], [20])
    with torch.no_grad():
        no_window = wide.compute_logits(wide(torch.tensor(ids), ctx))
    assert not torch.allclose(no_window[-1], hf_logits(tiny_gemma3, ids)[-1], atol=1e-3)


def test_gemma3_old_style_config_uses_pattern() -> None:
    cfg = ModelConfig.from_hf_config(
        {
            "model_type": "gemma3_text",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 7,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert cfg.layer_sliding == (True, True, True, True, True, False, True)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_local_theta) == ("linear", 8.0, 10000.0)
