"""Model families of the embedded engine and the registry that builds one from a `ModelConfig`.

Adding a family means one module here (a `CausalLM` subclass taking Hugging Face weight names)
plus one line in `_FAMILIES`, and a mapping in `ModelConfig.from_hf_config` (MoE families build on
`moe_decoder.MoECausalLM` and the block in `moe`). Weight loading from
files lives in `tokenops.engine.loader`; this package only builds modules and copies tensors in.
"""

from __future__ import annotations

import importlib

import torch

from tokenops.engine.models.base import CausalLM, ModelConfig

__all__ = ["CausalLM", "ModelConfig", "build_model", "family_class"]

# architecture -> "module:class", imported on first use
_FAMILIES = {
    "llama": "tokenops.engine.models.llama:LlamaForCausalLM",
    "gemma3": "tokenops.engine.models.gemma3:Gemma3ForCausalLM",
    "mixtral": "tokenops.engine.models.mixtral:MixtralForCausalLM",
    "qwen2_moe": "tokenops.engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "qwen3_moe": "tokenops.engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "olmoe": "tokenops.engine.models.olmoe:OlmoeForCausalLM",
}


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    routed_experts: bool = True,
) -> CausalLM:
    """An uninitialised model of `config`'s family on `device`; fill it with `load_weights`.

    Parameters are allocated without random init (meta device, then `to_empty`), which matters for
    a 160M-entry embedding table. `routed_experts=False`: MoE blocks get no routed-expert weights
    at all (`moe.ExpertFingerprints`), for an engine whose experts run on expert servers.
    """
    cls = family_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    if not routed_experts:
        from tokenops.engine.models.moe import leave_out_routed_experts

        leave_out_routed_experts(model, dtype)
    model = model.to_empty(device=device).to(dtype=dtype)
    return model.eval()


def family_class(architecture: str) -> type[CausalLM]:
    """The module class of `architecture` (its checkpoint spellings are class attributes)."""
    target = _FAMILIES.get(architecture)
    if target is None:
        raise ValueError(f"no model family registered for architecture {architecture!r}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
