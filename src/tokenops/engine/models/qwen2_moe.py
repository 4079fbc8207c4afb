"""The Qwen2-MoE family (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): biased q/k/v projections (o_proj has
none), many small routed experts, top-k gate weights left unnormalised unless `norm_topk_prob`,
and a shared expert every token passes through, scaled by a sigmoid gate (`shared_expert_gate`).
Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`, are dense.
"""

from __future__ import annotations

from tokenops.engine.models.moe_decoder import MoECausalLM


class Qwen2MoeForCausalLM(MoECausalLM):
    pass
