"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention with RMSNorm on each head
of the queries and keys, no biases, routed experts only (no shared expert), top-k gate weights
renormalised where `norm_topk_prob` (true in the released models).
"""

from __future__ import annotations

from tokenops.engine.models.moe_decoder import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    pass
