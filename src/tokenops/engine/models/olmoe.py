"""The OLMoE family (OLMoE-1B-7B): RMSNorm over the whole query and key projections (not per head),
optional clamping of q/k/v to +-`clip_qkv`, 64 experts top-8, gate weights unnormalised unless
`norm_topk_prob`, no shared expert.
"""

from __future__ import annotations

from tokenops.engine.models.moe_decoder import MoECausalLM


class OlmoeForCausalLM(MoECausalLM):
    pass
