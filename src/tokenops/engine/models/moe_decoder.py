"""The decoder the MoE families share: Llama-style attention (with each family's variant) and a
sparse MoE block, or a dense MLP, per layer; and the loading of per-expert checkpoints.

A family module (mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py) subclasses `MoECausalLM` and
names its checkpoint spellings; the shape differences (q/k norms, biases, shared experts, which
layers are sparse) all come from `ModelConfig`. The MoE block itself lives in `models.moe`.
Checkpoints on disk store every expert as its own tensors (`experts.<e>.gate_proj.weight`, or
Mixtral's `w1`/`w3`/`w2`); they are stacked here into the fused [E, ...] parameters one layer at a
time, so loading holds at most one layer's experts twice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tokenops.engine.attention import paged_attention
from tokenops.engine.context import ForwardContext
from tokenops.engine.models.base import ModelConfig
from tokenops.engine.models.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    Rope,
    keep,
)
from tokenops.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenops.engine.models.moe import GatedMLP, SparseMoeBlock


class MoEAttention(nn.Module):
    """GQA with RoPE through the paged kernel; optional q/k RMSNorm (per head or over the whole
    projection), q/k/v clamping and separate q/k/v and o_proj biases, as `ModelConfig` says."""

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
        self.clip = config.clip_qkv
        out_bias = config.attention_bias if config.attention_out_bias is None else config.attention_out_bias
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=out_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        elif config.qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        elif config.qk_norm != "none":
            raise ValueError(f"unknown qk_norm {config.qk_norm!r}")

    def forward(
        self, x: torch.Tensor, rope: Rope, ctx: ForwardContext, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`rows`: project only these rows' attention outputs (every row's K and V are still stored)."""
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        # contiguous: the native rope rotates in place and needs its own storage, not views of qkv
        q, k = rope(q.contiguous(), k.contiguous())
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, ctx, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj.forward(keep(o.reshape(-1, self.q_size), rows))


def moe_decoder_layer(config: ModelConfig, layer_idx: int) -> LlamaDecoderLayer:
    """Llama's layer wiring with the family's attention and, on sparse layers, the expert block."""
    assert config.moe is not None
    mlp = (
        SparseMoeBlock(config, layer_idx)
        if config.moe.sparse_layers[layer_idx]
        else GatedMLP(config.hidden_size, config.intermediate_size)
    )
    return LlamaDecoderLayer(config, layer_idx, self_attn=MoEAttention(config, layer_idx), mlp=mlp)


# <prefix>.experts.<e>.<part>.weight, the per-expert spelling of checkpoints on disk
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
# transformers 5's fused spelling: every expert of a layer in one [E, ...] tensor per projection
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>gate_up_proj|down_proj)$")


class MoECausalLM(LlamaForCausalLM):
    """An MoE decoder-only model; families set `expert_parts` and `renames` for their checkpoints."""

    # checkpoint name of each expert projection -> gate | up | down
    expert_parts: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # checkpoint sub-name -> ours, applied before anything else (Mixtral's block_sparse_moe -> mlp)
    renames: dict[str, str] = {}

    make_layer = staticmethod(moe_decoder_layer)

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} needs an MoE spec in its config")
        super().__init__(config)
        # set by `ExpertClient.attach(model, overlap=True)`: steps of two or more sequences run as
        # two micro-batches, one's attention computed while the other's experts are on the servers
        self.remote_experts: RemoteExperts | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.remote_experts is None or ctx.num_seqs < 2 or num_layers is not None:
            return super().forward(input_ids, ctx, num_layers, rows)
        # double batching keeps every row to the end: its halves' last layers are interleaved
        return keep(self._double_batched(input_ids, ctx), rows)

    def _double_batched(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The paper's double batching: per layer, micro-batch A's attention, A's experts sent, B's
        attention while they compute, B's experts sent, then A's collected and its next layer's
        attention computed while B's experts compute. Each token's arithmetic is the same as in
        one batch; only the order of the layer calls changes."""
        remote = self.remote_experts
        assert remote is not None
        half = ctx.num_seqs // 2
        cut = sum(ctx.query_lens[:half])
        ctxs = (sub_context(ctx, 0, half, 0, cut), sub_context(ctx, half, ctx.num_seqs, cut, len(input_ids)))
        embedded = self.model.embed_tokens(input_ids)
        hs: list[torch.Tensor] = [embedded[:cut], embedded[cut:]]
        ropes = [self.rotary(c.positions, embedded.dtype) for c in ctxs]
        residuals: list[torch.Tensor | None] = [None, None]
        in_flight: list[tuple[SparseMoeBlock, torch.Tensor, object] | None] = [None, None]
        for layer in self.model.layers:
            for i in (0, 1):
                if in_flight[i] is not None:
                    hs[i] = _finish(remote, in_flight[i])
                    in_flight[i] = None
                if residuals[i] is None:
                    x, residuals[i] = layer.input_layernorm.forward(hs[i]), hs[i]
                else:
                    x, residuals[i] = layer.input_layernorm.forward_add(hs[i], residuals[i])
                attn = layer.self_attn.forward(x, ropes[i], ctxs[i])
                x, residuals[i] = layer.post_attention_layernorm.forward_add(attn, residuals[i])
                if isinstance(layer.mlp, SparseMoeBlock):
                    ids, weights = layer.mlp.route(x)
                    in_flight[i] = (layer.mlp, x, remote.submit(layer.mlp.layer_idx, x, ids, weights))
                else:
                    hs[i] = layer.mlp.forward(x)
        for i in (0, 1):
            if in_flight[i] is not None:
                hs[i] = _finish(remote, in_flight[i])
        return self.model.norm.forward_add(torch.cat(hs), torch.cat(residuals))[0]

    @classmethod
    def renamed(cls, name: str) -> str:
        for old, new in cls.renames.items():
            name = name.replace(old, new)
        return name

    @classmethod
    def expert_tensor(cls, name: str) -> tuple[str, int, str] | None:
        """(prefix, expert, gate | up | down) of a renamed per-expert checkpoint tensor, else None."""
        m = _EXPERT_TENSOR.match(name)
        if m is None or m["part"] not in cls.expert_parts:
            return None
        return m["prefix"], int(m["expert"]), cls.expert_parts[m["part"]]

    @classmethod
    def is_routed_expert(cls, name: str) -> bool:
        """Whether a checkpoint tensor holds routed-expert weights (per expert or fused)."""
        name = cls.renamed(name)
        return cls.expert_tensor(name) is not None or FUSED_EXPERTS.match(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._fused_experts(weights))

    def _fused_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass tensors through, renamed; stack per-expert ones into `experts.gate_up_proj` /
        `experts.down_proj`, yielding a layer's pair as soon as all its experts are in."""
        assert self.config.moe is not None
        num_experts = self.config.moe.num_experts
        pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for name, tensor in weights:
            name = self.renamed(name)
            found = self.expert_tensor(name)
            if found is None:
                yield name, tensor
                continue
            prefix, expert, part = found
            if expert >= num_experts:
                raise ValueError(f"checkpoint has expert {expert} in {name}, the config has {num_experts}")
            parts = pending.setdefault(prefix, {})
            parts[(expert, part)] = tensor
            if len(parts) == 3 * num_experts:
                yield from _stack(prefix, pending.pop(prefix), num_experts)
        for prefix, parts in pending.items():
            have = sorted({e for e, _ in parts})
            raise ValueError(
                f"checkpoint lacks weights: {prefix} has tensors of experts {have[:8]} only, "
                f"of {num_experts}, or misses some of their gate/up/down parts"
            )


class RemoteExperts(Protocol):
    """Where double batching sends a layer's routed tokens (`eaas.client.ExpertClient`)."""

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> object: ...

    def collect(self, call: object) -> torch.Tensor: ...


def _finish(remote: RemoteExperts, in_flight: tuple[SparseMoeBlock, torch.Tensor, object]) -> torch.Tensor:
    block, x, call = in_flight
    shared = block.shared_output(x)  # computed here while the servers finish the routed experts
    routed = remote.collect(call)
    return routed if shared is None else routed + shared


def sub_context(ctx: ForwardContext, first: int, end: int, row: int, row_end: int) -> ForwardContext:
    """The sequences [first, end) of a step, whose tokens are rows [row, row_end): a step of its own
    over the same KV caches (no logits rows: the caller projects the joined hidden states)."""
    return ForwardContext(
        positions=ctx.positions[row:row_end],
        slot_mapping=ctx.slot_mapping[row:row_end],
        block_tables=ctx.block_tables[first:end],
        query_lens=ctx.query_lens[first:end],
        context_lens=ctx.context_lens[first:end],
        block_size=ctx.block_size,
        kv_caches=ctx.kv_caches,
        kv_gaps=ctx.kv_gaps[first:end] if ctx.kv_gaps else None,
    )


def _stack(
    prefix: str, parts: dict[tuple[int, str], torch.Tensor], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        gate_up = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(num_experts)])
        down = torch.stack([parts[(e, "down")] for e in range(num_experts)])
    except KeyError as missing:
        raise ValueError(f"checkpoint lacks weights: {prefix} has no {missing.args[0]}") from None
    except RuntimeError as err:  # shapes that do not stack
        raise ValueError(f"expert weights of {prefix} do not fit together: {err}") from None
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.down_proj", down
