"""The Mixtral family (Mixtral 8x7B / 8x22B and its fine-tunes): Llama attention (optionally with a
sliding window on every layer) and a sparse MoE block of SiLU experts, top-2 of 8 in the released
models, gate weights always renormalised over the chosen experts, no shared expert.

Checkpoints spell the block `block_sparse_moe` and an expert's projections `w1` (gate), `w3` (up)
and `w2` (down); transformers 5 loads them into `mlp.experts.gate_up_proj` / `down_proj`, as we do.
"""

from __future__ import annotations

from tokenops.engine.models.moe_decoder import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    # w1/w3/w2 in HF checkpoints; GGUF files, read per expert, use the generic spelling
    expert_parts = {
        "w1": "gate",
        "w3": "up",
        "w2": "down",
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    }
    renames = {".block_sparse_moe.": ".mlp."}
