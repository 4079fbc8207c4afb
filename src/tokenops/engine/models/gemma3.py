"""The Gemma 3 text family: interleaved sliding-window and global attention layers.

What sets it apart from Llama, each mirrored from transformers' modeling_gemma3: RMSNorm weights
stored as offsets from 1; embeddings scaled by sqrt(hidden); RMS-normed queries and keys (QK-norm);
attention scaled by `query_pre_attn_scalar ** -0.5`; sliding layers use their own (local) RoPE
theta and attend only to the last `sliding_window` positions; norms before and after both the
attention and the GELU-tanh MLP; optional final logit soft-capping.
"""

from __future__ import annotations

from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.attention import paged_attention
from tokenops.engine.context import ForwardContext
from tokenops.engine.models.base import CausalLM, ModelConfig
from tokenops.engine.models.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    VocabProjection,
    gelu_tanh_and_mul,
    keep,
    rope_inv_freq,
)


def _gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


# act(gate) * up over the fused gate|up projection, by HF's hidden_activation
_GATED_ACTIVATIONS = {
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu": _gelu_and_mul,
}


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_window if config.is_sliding(layer_idx) else None
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=True)

    def forward(
        self, x: torch.Tensor, rope: Rope, ctx: ForwardContext, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`rows`: project only these rows' attention outputs (every row's K and V are still stored)."""
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm.forward(q.view(-1, self.num_heads, self.head_dim))
        q, k = rope(q, self.k_norm.forward(k.view(-1, self.num_kv_heads, self.head_dim)))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, ctx, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj.forward(keep(o.reshape(-1, self.q_size), rows))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        act_and_mul = _GATED_ACTIVATIONS.get(config.hidden_act)
        if act_and_mul is None:
            raise ValueError(f"gemma3 MLP does not support hidden_activation {config.hidden_act!r}")
        self.act_and_mul = act_and_mul
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = config.is_sliding(layer_idx)
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        ctx: ForwardContext,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output, not yet added to the residual stream (for the first layer:
        the embeddings, and residual None). Returns this layer's output and the stream before it, for
        `rows` only where given (attention still reads and stores every row's K and V)."""
        # each residual add is fused into the pre-norm that reads the sum (the post-norms apply to a
        # sublayer's output before it joins the stream); sublayers are called through .forward,
        # skipping nn.Module's hook dispatch (none are registered on the engine's models)
        if residual is None:
            x, residual = self.input_layernorm.forward(h), h
        else:
            x, residual = self.input_layernorm.forward_add(h, residual)
        h = self.post_attention_layernorm.forward(self.self_attn.forward(x, rope, ctx, rows))
        x, residual = self.pre_feedforward_layernorm.forward_add(h, keep(residual, rows))
        return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # _weight skips the random init (a normal_ over the whole table; slow even on the meta device)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3TextModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # the head's kernel depends on how many rows it projects (layers.VocabProjection)
        self.vocab_projection = VocabProjection()
        # rope scaling (e.g. linear x8 on the larger Gemma 3) applies to the global layers only
        self.global_rotary = RotaryEmbedding(
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_type, config.rope_factor)
        )
        self.local_rotary = RotaryEmbedding(
            rope_inv_freq(config.head_dim, config.rope_local_theta or 10000.0)
        )
        self.embed_scale = config.hidden_size**0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        # HF rounds the scale to the weight dtype before multiplying; so do we
        h = self.model.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=weight.dtype)
        rope_global = self.global_rotary(ctx.positions, h.dtype)
        rope_local = self.local_rotary(ctx.positions, h.dtype)
        residual = None
        last = len(self.model.layers) - 1 if num_layers is None else num_layers - 1
        # islice: slicing a ModuleList would build (and register modules into) a new one every step
        for i, layer in enumerate(islice(self.model.layers, num_layers)):
            rope = rope_local if layer.is_sliding else rope_global
            h, residual = layer.forward(h, residual, rope, ctx, rows if i == last else None)
        return self.model.norm(h) if residual is None else self.model.norm.forward_add(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.vocab_projection(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
