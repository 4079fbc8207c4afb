"""What every model family shares: the `ModelConfig` the engine reads and the `CausalLM` base class.

`ModelConfig` is the one description of a model's shape that the rest of the engine (KV-cache
sizing, scheduler limits, loaders) sees; it is built from a Hugging Face config.json dict or from
GGUF metadata (the GGUF reader maps its keys onto the HF names first). Family modules subclass
`CausalLM`; the family registry lives in `models/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from tokenops.engine.context import ForwardContext
from tokenops.engine.models.layers import expected_loads, load_into

# HF model_type -> our architecture name
_ARCHITECTURES = {
    "llama": "llama",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # the multimodal wrapper: only its text_config is used
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
}


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model's shape (`models.moe` builds the block from it)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k gate weights to sum to 1 (Mixtral always does)
    sparse_layers: tuple[bool, ...]  # per layer: True where the MLP is the MoE block, else a dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output is scaled by sigmoid(x @ g)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a value of _ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    sliding_window: int | None = None
    layer_sliding: tuple[bool, ...] = ()  # per layer: True where the layer uses the sliding window
    # rope scaling (HF "rope_scaling" / "rope_parameters"); for Gemma 3 it applies to global layers only
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_local_theta: float | None = None  # Gemma 3: theta of the sliding-window layers
    # per-frequency divisors (GGUF "rope_freqs" tensor, how llama.cpp stores Llama 3.1 scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None  # bias on o_proj; None: as attention_bias (Qwen2-MoE: False)
    # RMSNorm of queries and keys: "head" (per head, Qwen3), "full" (whole width, OLMoE)
    qk_norm: str = "none"
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv
    moe: MoESpec | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in set(_ARCHITECTURES.values()):
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.layer_sliding and len(self.layer_sliding) != self.num_layers:
            raise ValueError("layer_sliding must name every layer")
        if any(self.layer_sliding) and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError("moe.sparse_layers must name every layer")

    def with_overrides(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_sliding) and self.layer_sliding[layer]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4 or 5 spelling)."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        arch = _ARCHITECTURES.get(model_type)
        if arch is None:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
            )
        num_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
        num_layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if arch == "llama":
            rope = _rope_params(
                cfg.get("rope_parameters"), cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
            )
            return cls(
                **common,
                **_rope_fields(rope),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                hidden_act=cfg.get("hidden_act", "silu"),
            )
        if arch in _MOE_FAMILIES:
            return _moe_config(cls, cfg, arch, common)
        # gemma3
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: one rope dict per layer type
            global_rope = _rope_params(params["full_attention"], 1_000_000.0, None)
            local_theta = float((params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
        else:
            global_rope = _rope_params(None, cfg.get("rope_theta", 1_000_000.0), cfg.get("rope_scaling"))
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        layer_types = cfg.get("layer_types")
        if layer_types:
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        else:
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attention logit softcapping (Gemma 2) is not supported")
        return cls(
            **common,
            **_rope_fields(global_rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            sliding_window=int(cfg.get("sliding_window") or 4096),
            layer_sliding=sliding,
            rope_local_theta=local_theta,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _moe_config(cls: type[ModelConfig], cfg: dict, arch: str, common: dict[str, Any]) -> ModelConfig:
    """The MoE families: Llama-style attention and norms around a sparse MoE block, each with its
    own spelling of the expert shape in config.json."""
    num_layers = common["num_layers"]
    # transformers writes num_experts or num_local_experts depending on the family and version
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts <= 0:
        raise ValueError(f"{arch} config.json names no experts (num_experts / num_local_experts)")
    if arch in ("mixtral", "olmoe"):
        expert_size = int(cfg["intermediate_size"])
        sparse = (True,) * num_layers
    else:
        expert_size = int(cfg["moe_intermediate_size"])
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    moe = MoESpec(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 2),
        expert_intermediate_size=expert_size,
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe"
        else 0,
        shared_expert_gate=arch == "qwen2_moe" and bool(cfg.get("shared_expert_intermediate_size")),
    )
    window = cfg.get("sliding_window")
    if arch == "mixtral":
        sliding = (True,) * num_layers if window else ()
    elif cfg.get("use_sliding_window") and cfg.get("layer_types"):
        sliding = tuple(t == "sliding_attention" for t in cfg["layer_types"])
    else:
        sliding = ()
    if arch == "qwen2_moe":
        # transformers 4 spells no flag: Qwen2's q/k/v always carry a bias, o_proj never
        common = {**common, "attention_bias": bool(cfg.get("qkv_bias", True))}
    rope = _rope_params(cfg.get("rope_parameters"), cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling"))
    return cls(
        **common,
        **_rope_fields(rope),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=int(window) if any(sliding) else None,
        layer_sliding=sliding if any(sliding) else (),
        attention_out_bias=False if arch == "qwen2_moe" else None,
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(arch, "none"),
        clip_qkv=float(cfg["clip_qkv"]) if cfg.get("clip_qkv") is not None else None,
        moe=moe,
    )


def _rope_params(parameters: dict | None, theta: float, scaling: dict | None) -> dict:
    if parameters and "rope_theta" in parameters:
        return dict(parameters)
    out = {"rope_theta": theta, "rope_type": "default"}
    if scaling:
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    return out


def _rope_fields(rope: dict) -> dict[str, Any]:
    return dict(
        rope_theta=float(rope["rope_theta"]),
        rope_type=str(rope.get("rope_type") or "default"),
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings") or 8192),
    )


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache.

    `forward` maps the step's flattened tokens to final hidden states; `compute_logits` projects the
    rows whose logits are wanted. Weight names in `load_weights` are Hugging Face's.
    """

    config: ModelConfig
    # HF sub-name -> (our merged sub-name, shard index): the fused q|k|v and gate|up projections that
    # every family built on layers.MergedLinear shares; a family with other fusions overrides it
    stacked_params: dict[str, tuple[str, int]] = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] -> [T, hidden], or [len(rows), hidden] for the ascending row indices `rows`: the last
        layer projects and runs its MLP for those rows alone, since no other row's output is read
        (every row's K and V are still stored). `num_layers` runs only the first layers (then the
        final norm): the self-draft of speculative decoding."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        raise NotImplementedError

    def skip_weight(self, name: str) -> bool:
        """True for checkpoint tensors the model does not need (e.g. a tied lm_head)."""
        return "rotary_emb.inv_freq" in name or (self.config.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be written exactly once, or this raises."""
        params = dict(self.named_parameters())
        expected = expected_loads(self, self.stacked_params)
        seen: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            written = load_into(self, params, name, tensor, self.stacked_params)
            if written is None:
                unknown.append(name)
            else:
                seen.add(written)
        if unknown:
            raise ValueError(
                f"checkpoint has weights this {self.config.architecture} model does not know: {unknown[:5]}"
            )
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
