"""An int8 copy of the output projection behind an instance-level `compute_logits`
(`quantize_logits_head`): an experiment that engine_quantization.py measures; the engine's
`quantization` knob keeps the head in full precision and never uses it."""

from __future__ import annotations

import torch
from torch import nn

from tokenops.engine.quantize.int8 import KERNEL_MAX_ROWS, Int8WeightOnlyLinear
from tokenops.engine.quantize.int8_dynamic import DynamicInt8Linear, dynamic_int8_unavailable


class _Int8LogitsHead:
    """compute_logits over an int8 copy of the output projection (weight-only, or W8A8 with
    `dynamic`), then the family's soft-capping.

    The families compute logits as F.linear(hidden, head weight) (tied: the embedding), then
    Gemma soft-caps them; this repeats that on the quantised weight. The embedding stays float
    for the input lookup, so a tied model holds both copies (+25% of the table's float32 bytes).
    """

    def __init__(self, model: nn.Module, kernel_max_rows: int, dynamic: bool = False) -> None:
        lm_head = getattr(model, "lm_head", None)
        weight = model.model.embed_tokens.weight if lm_head is None else lm_head.weight
        linear = _as_linear(weight)
        self.linear = (
            DynamicInt8Linear.from_linear(linear)
            if dynamic
            else Int8WeightOnlyLinear.from_linear(linear, kernel_max_rows)
        )
        self.cap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


def quantize_logits_head(
    model: nn.Module, kernel_max_rows: int = KERNEL_MAX_ROWS, dynamic: bool = False
) -> None:
    """Make `model.compute_logits` read an int8 copy of the output projection (Llama, Gemma 3);
    `dynamic`: a `DynamicInt8Linear` (W8A8, CPU) instead of the weight-only one."""
    if model.compute_logits.__class__ is _Int8LogitsHead:
        return
    if dynamic and (reason := dynamic_int8_unavailable(next(model.parameters()).device)):
        raise ValueError(reason)
    head = _Int8LogitsHead(model, kernel_max_rows, dynamic)
    model.add_module("logits_head_int8", head.linear)  # so .to() and weight_bytes see it
    model.compute_logits = head  # instance attribute: shadows the family's method
