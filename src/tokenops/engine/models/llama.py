"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, ...): GQA, RoPE, RMSNorm, SiLU-gated MLP.

Q, K and V are one fused projection and gate/up another, so a step does two large matmuls per
block instead of five. Attention goes through the engine's paged kernel; this module never sees
blocks or sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import torch
from torch import nn

from tokenops.engine.attention import one_call_attention_args, paged_attention_qkv
from tokenops.engine.context import ForwardContext
from tokenops.engine.models.base import CausalLM, ModelConfig
from tokenops.engine.models.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    VocabProjection,
    input_dtype,
    keep,
    rope_inv_freq,
    silu_and_mul,
)
from tokenops.engine.quantize import int4
from tokenops.engine.quantize.common import native_ops


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)

    def forward(
        self, x: torch.Tensor, rope: Rope, ctx: ForwardContext, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`rows`: project only these rows' attention outputs (every row's K and V are still stored)."""
        qkv = self.qkv_proj.forward(x)
        o = paged_attention_qkv(
            qkv, rope, ctx, self.layer_idx, self.scale, self.num_heads, self.num_kv_heads, self.head_dim
        )
        return self.o_proj.forward(keep(o.reshape(-1, self.q_size), rows))

    def input_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the q|k|v projection computes x in (`input_dtype` of the linears that have one)."""
        return input_dtype(self.qkv_proj, x)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"llama MLP supports hidden_act 'silu', got {config.hidden_act!r}")
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # int4 on the tiles: the projection and its activation in one pass, as the one-call layer runs it
        act = gate_up.forward_silu_mul(x) if isinstance(gate_up, int4.Int4WeightOnlyLinear) else None
        return self.down_proj.forward(silu_and_mul(gate_up.forward(x)) if act is None else act)

    def input_dtype(self, x: torch.Tensor) -> torch.dtype:
        return input_dtype(self.gate_up_proj, x)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP; families that keep this wiring pass their own sublayers (the MoE
    families: their attention variant and an expert block)."""

    one_call = True  # False: never the one-native-call path (`_one_call_parts`; tests compare the two)
    # its norms take a sublayer's output in bf16 and widen it as they add it (`quantize_model` lets the
    # output projections hand their bf16 GEMM's result on uncast)
    reads_bf16_sublayer_outputs = True

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(config, layer_idx)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        # each residual add is fused into the norm that reads the sum; sublayers are called through
        # .forward, skipping nn.Module's hook dispatch (none are registered on the engine's models)
        # each norm writes its result in the dtype the next projection computes in (bf16 for a bf16
        # GEMM on a float32 stream), sparing that projection its cast; h may be bf16 (`quantize_model`'s
        # output projections), the stream is not
        if residual is None:
            x, residual = self.input_layernorm.forward(h, input_dtype(self.self_attn, h)), h
        else:
            x, residual = self.input_layernorm.forward_add(h, residual, input_dtype(self.self_attn, residual))
        h = self.self_attn.forward(x, rope, ctx, rows)
        residual = keep(residual, rows)
        x, residual = self.post_attention_layernorm.forward_add(h, residual, input_dtype(self.mlp, residual))
        return self.mlp.forward(x), residual

    def _one_call_parts(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> tuple | None:
        """(the native ops, `_one_call_weights()`, `one_call_attention_args`) where this layer can run
        inside one native call (`tokenops::llama_layers_q4`: the same ops as `forward`, in order, so
        the same bits) on these inputs (residual None: the first layer's, which starts the stream):
        int4 tiles for all four projections, the native attention's one-call prologue; else None.
        `LlamaForCausalLM.forward` makes the calls."""
        if not self.one_call:
            return None
        weights = self._one_call_weights()
        if weights is None or h.dim() != 2 or not h.is_contiguous():
            return None
        if residual is not None and not residual.is_contiguous():
            return None
        rows = h.shape[0]
        native = native_ops(h, rows, int4.NATIVE_MAX_ROWS)
        if native is None or not int4.takes_tiles(h, rows):
            return None
        args = one_call_attention_args(ctx, rope, self._modules["self_attn"].layer_idx)
        if args is None:
            return None
        return native, weights, args

    def _one_call_weights(self) -> tuple | None:
        """(norm weights, the projections' codes / d / m, out features, group size, float32 biases, eps)
        for `_one_call_parts`, or None where the layer is not Llama's own int4 layer; rebuilt when a weight
        tensor is replaced (a load, `.to()`), as the int4 layer's own argument cache is."""
        attn, mlp = self._modules["self_attn"], self._modules["mlp"]
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        linears = [
            attn._modules["qkv_proj"],
            attn._modules["o_proj"],
            mlp._modules["gate_up_proj"],
            mlp._modules["down_proj"],
        ]
        if not all(isinstance(m, int4.Int4WeightOnlyLinear) and m.native for m in linears):
            return None
        norms = [self._modules["input_layernorm"], self._modules["post_attention_layernorm"]]
        tensors = [n._parameters["weight"] for n in norms]
        tensors += [m._buffers[b] for m in linears for b in ("weight_packed", "scales_and_zeros", "bias")]
        key = tuple(map(id, tensors))
        cached = self.__dict__.get("_one_call_cache")
        if cached is not None and cached[0] == key:
            return cached[2]
        weights = None
        sizes = {m.group_size for m in linears}
        if len(sizes) == 1 and norms[0].eps == norms[1].eps and not any(n.unit_offset for n in norms):
            codes, biases = [], []
            for m in linears:
                d, mins, bias = m._native_args()
                codes += [m.weight_packed, d, mins]
                biases.append(bias)
            out = [m.out_features for m in linears]
            weights = ([n.weight.detach() for n in norms], codes, out, sizes.pop(), biases, norms[0].eps)
        # the cache holds the tensors alive, so none of their ids is reused while it is kept
        self.__dict__["_one_call_cache"] = (key, tensors, weights)
        return weights


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module] = LlamaDecoderLayer
    ) -> None:
        super().__init__()
        # _weight skips the random init (a normal_ over the whole table; slow even on the meta device)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    # the decoder layer per index; families that keep Llama's wiring with other sublayers replace it
    make_layer: Callable[[ModelConfig, int], nn.Module] = LlamaDecoderLayer
    # consecutive one-call layers as one native call (`_one_call_run`); False: a call per layer
    one_call_runs = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self).make_layer)
        # tied: compute_logits reads the embedding matrix, so there is no second copy to keep in sync
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # the head's kernel depends on how many rows it projects (layers.VocabProjection)
        self.vocab_projection = VocabProjection()
        inv_freq = rope_inv_freq(
            config.head_dim,
            config.rope_theta,
            config.rope_type,
            config.rope_factor,
            config.rope_low_freq_factor,
            config.rope_high_freq_factor,
            config.rope_original_max_position,
        )
        if config.rope_freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
        self.rotary = RotaryEmbedding(inv_freq)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary(ctx.positions, h.dtype)
        residual = None
        # islice: slicing a ModuleList would build (and register modules into) a new one every step
        layers = list(islice(self.model.layers, num_layers))
        last = len(layers) - 1
        i = 0
        while i <= last:
            end, h_run = self._one_call_run(layers, i, last, rows, h, residual, rope, ctx)
            if end > i:
                # the run wrote the stream before its last layer into `residual` (a zero one it
                # made where it began the stream)
                h, i, residual = h_run[0], end, h_run[1]
                continue
            h, residual = layers[i].forward(h, residual, rope, ctx, rows if i == last else None)
            i += 1
        return self.model.norm(h) if residual is None else self.model.norm.forward_add(h, residual)[0]

    def _one_call_run(
        self,
        layers: list[nn.Module],
        i: int,
        last: int,
        rows: torch.Tensor | None,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        ctx: ForwardContext,
    ) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
        """Layers i, i + 1, ... that each can run inside one native call (`_one_call_parts`), as one
        `tokenops::llama_layers_q4` call (the same ops per layer in order: the same bits), a single
        layer where `one_call_runs` is off: (the layer after them, (the output, the stream)), or
        (i, None) where layer i cannot. The last layer joins only where it keeps every row. The first
        layer (residual None) joins over a zero stream: its fused norm of h + 0 is the norm of h to the
        bit, and it writes h + 0 into the stream, which is h (but for the sign of a zero) where the
        op-by-op layer keeps h itself."""
        parts = []
        stop = last + 1 if rows is None else last
        for j in range(i, stop if self.one_call_runs else min(stop, i + 1)):
            layer = layers[j]
            p = (
                layer._one_call_parts(h, residual, rope, ctx)
                if isinstance(layer, LlamaDecoderLayer)
                else None
            )
            # one shape of projections and attention for the run (a model's layers share them)
            if p is None or (parts and (p[1][2:4], p[1][5]) != (parts[0][1][2:4], parts[0][1][5])):
                break
            parts.append(p)
        if not parts:
            return i, None
        if residual is None:
            residual = torch.zeros_like(h)
        attn = layers[i]._modules["self_attn"]
        native, (_, _, out_features, group_size, _, eps), shared = parts[0]
        norms, codes, biases, keys, values, key_scales, value_scales = [], [], [], [], [], [], []
        for _, (n, c, _, _, b, _), (k, v, ks, vs, *_) in parts:
            norms += n
            codes += c
            biases += b
            keys.append(k)
            values.append(v)
            key_scales.append(ks)
            value_scales.append(vs)
        out = native.llama_layers_q4(
            h,
            residual,
            norms,
            eps,
            codes,
            out_features,
            group_size,
            biases,
            rope.cos,
            rope.sin,
            keys,
            values,
            key_scales,
            value_scales,
            *shared[4:],  # slots, block tables, query starts and lengths, kept lengths, gaps
            attn.scale,
            attn.num_heads,
            attn.num_kv_heads,
        )
        return i + len(parts), (out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.vocab_projection(hidden, weight).float()
