"""The mixture-of-experts block: top-k router, grouped expert execution, shared experts, load counts.

`SparseMoeBlock` is what the MoE families put where a dense model has its MLP: a softmax router
picks `top_k` experts per token (weights renormalised where the family says so), the chosen
experts run as one grouped computation (`Experts`), and an optional shared expert (DeepSeek /
Qwen2-MoE style, optionally behind a sigmoid gate) adds its output for every token. The block
counts the tokens routed to each expert (`tokens_per_expert`), which `expert_load` reads for
`/metrics` and `/v1/load`. Where the experts run is pluggable: `SparseMoeBlock.dispatch` is the
local `Experts` by default and can be swapped for any `ExpertDispatch` (the Expert-as-a-Service
client sends the tokens to expert servers). Weight names are transformers 5's fused
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]; per-expert checkpoints are
fused on load by `moe_decoder`.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenops.engine.models.base import ModelConfig
from tokenops.engine.models.layers import Linear, MergedLinear, silu_and_mul


class ExpertDispatch(Protocol):
    """Computes the routed experts of one layer: sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


def _probe_grouped_mm() -> bool:
    try:
        x, w = torch.ones(3, 4), torch.ones(2, 4, 5)
        y = torch._grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32))
        return bool(torch.allclose(y, torch.full((3, 5), 4.0)))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


_GROUPED_MM: bool | None = None


def grouped_mm_available() -> bool:
    """True where this PyTorch build runs `torch._grouped_mm` on CPU tensors (probed once)."""
    global _GROUPED_MM
    if _GROUPED_MM is None:
        _GROUPED_MM = _probe_grouped_mm()
    return _GROUPED_MM


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): `order` lists the flattened (token, k) slots grouped by expert, experts in
    ascending order; `counts[e]` is how many slots chose expert e."""
    flat = ids.reshape(-1)
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def run_experts_grouped(
    xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, use_grouped_mm: bool
) -> torch.Tensor:
    """SiLU-gated expert MLPs over rows already grouped by expert: rows [offs[e-1], offs[e]) go to
    expert e. gate_up: [E, 2I, H], down: [E, H, I] (HF layout). One grouped matmul per projection
    where `torch._grouped_mm` exists, else one matmul per expert that has rows."""
    if use_grouped_mm and xs.dtype in (torch.float32, torch.bfloat16):
        offs = counts.cumsum(0).to(torch.int32)
        # transposed views: the grouped kernel reads [E, in, out] without a second copy of the weights
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
        return torch._grouped_mm(silu_and_mul(h), down.transpose(1, 2), offs=offs)
    out = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            out[rows] = F.linear(silu_and_mul(F.linear(xs[rows], gate_up[e])), down[e])
            start += n
    return out


def expert_hasher() -> hashlib.blake2b:
    """The hash an expert's fingerprint is made of: feed it the float32 bytes of its gate, up and
    down weights in that order (row-major, in any chunks), then `finish_fingerprint`."""
    return hashlib.blake2b(digest_size=16)


def finish_fingerprint(hasher: hashlib.blake2b, mode: str | None = None) -> bytes:
    """The fingerprint of the weights fed to `hasher` computed in format `mode` (None: float)."""
    h = hasher.copy()
    if mode is not None:
        h.update(mode.encode())
    return h.digest()


def expert_fingerprint(gate_up: torch.Tensor, down: torch.Tensor, mode: str | None = None) -> bytes:
    """16 bytes identifying one expert's float weights and the format it computes in (BLAKE2b of
    the float32 bytes, then the quantisation mode): an expert server whose weights or format differ
    from the client's is refused at registration."""
    h = expert_hasher()
    for t in (gate_up, down):
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return finish_fingerprint(h, mode)


class RoutedExperts(nn.Module):
    """The routed experts of one layer, computed for a step's tokens by grouped execution: the
    (token, k) pairs are sorted by expert so each expert's rows are contiguous, `run` computes every
    expert once over its rows, and the results are scattered back weighted by the gate."""

    num_experts: int
    hidden_size: int
    dtype: torch.dtype

    def run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs for rows grouped by expert: `counts[e]` rows of expert e, in order."""
        raise NotImplementedError

    def fingerprint(self, e: int) -> bytes:
        raise NotImplementedError

    def subset(self, ids: list[int]) -> RoutedExperts:
        """The experts `ids` only, as experts 0..len(ids)-1 (an expert server's share)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[-1]
        order, counts = sort_by_expert(ids, self.num_experts)
        token = order // top_k
        y = self.run(x[token], counts)
        y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token, y)


class Experts(RoutedExperts):
    """All routed experts of one layer, stacked in the model dtype: one grouped matmul per projection."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @classmethod
    def of(cls, gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
        """Experts over these stacked weights ([n, 2I, H], [n, H, I]), without copying them."""
        with torch.device("meta"):
            experts = cls(gate_up.shape[0], gate_up.shape[2], down.shape[2])
        experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = nn.Parameter(down, requires_grad=False)
        return experts

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up_proj.dtype

    def run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grouped = grouped_mm_available() and xs.device.type == "cpu"
        return run_experts_grouped(xs, counts, self.gate_up_proj, self.down_proj, grouped)

    def fingerprint(self, e: int) -> bytes:
        return expert_fingerprint(self.gate_up_proj[e], self.down_proj[e])

    def subset(self, ids: list[int]) -> Experts:
        index = torch.tensor(ids)
        with torch.no_grad():
            return Experts.of(self.gate_up_proj[index].clone(), self.down_proj[index].clone())


class QuantizedExperts(RoutedExperts):
    """The routed experts with each expert's gate|up and down projections in one of the engine's
    quantised linear formats (`quantize`'s int8, int8_dynamic, int4 or bf16 layers), run expert by
    expert over its contiguous rows (the quantised kernels have no grouped form)."""

    def __init__(self, experts: Experts, mode: str, group_size: int = 32) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.mode = experts.num_experts, experts.hidden_size, mode
        self._dtype = experts.dtype
        with torch.no_grad():
            self.gate_up = nn.ModuleList(
                _quantised_linear(experts.gate_up_proj[e], mode, group_size) for e in range(self.num_experts)
            )
            self.down = nn.ModuleList(
                _quantised_linear(experts.down_proj[e], mode, group_size) for e in range(self.num_experts)
            )
        gate_up, down = experts.gate_up_proj, experts.down_proj
        self.fingerprints = [expert_fingerprint(gate_up[e], down[e], mode) for e in range(self.num_experts)]

    @classmethod
    def of(
        cls,
        gate_up: list[nn.Module],
        down: list[nn.Module],
        mode: str,
        fingerprints: list[bytes],
        dtype: torch.dtype,
    ) -> QuantizedExperts:
        """Experts over quantised layers made elsewhere (a GGUF file's 4-bit blocks), per expert."""
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        experts.num_experts, experts.mode, experts._dtype = len(gate_up), mode, dtype
        experts.hidden_size = down[0].out_features
        experts.gate_up, experts.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        experts.fingerprints = list(fingerprints)
        return experts

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty(xs.shape[0], self.hidden_size, dtype=xs.dtype, device=xs.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                out[rows] = self.down[e](silu_and_mul(self.gate_up[e](xs[rows])))
                start += n
        return out

    def fingerprint(self, e: int) -> bytes:
        return self.fingerprints[e]

    def subset(self, ids: list[int]) -> QuantizedExperts:
        part = copy.copy(self)  # shares the chosen experts' quantised layers
        part._modules = dict(self._modules)
        part.num_experts = len(ids)
        part.gate_up = nn.ModuleList(self.gate_up[e] for e in ids)
        part.down = nn.ModuleList(self.down[e] for e in ids)
        part.fingerprints = [self.fingerprints[e] for e in ids]
        return part


class ExpertFingerprints(RoutedExperts):
    """The routed experts of one layer as a client of expert servers knows them: their shape and
    fingerprints, not their weights, which live on the servers (`loader.load_model(...,
    routed_experts=False)`). The hashes are filled by the loader after the model is built; running
    the experts here is an error."""

    def __init__(
        self, num_experts: int, hidden_size: int, dtype: torch.dtype, mode: str | None = None
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.mode = num_experts, hidden_size, mode
        self._dtype = dtype
        self.hashes: list[hashlib.blake2b] | None = None  # per expert, `expert_hasher` fed its weights

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "this model was loaded without its routed experts (they run on expert servers): "
            "attach an ExpertClient (`tokenops engine --expert-server`) before running it"
        )

    def fingerprint(self, e: int) -> bytes:
        if self.hashes is None:
            raise RuntimeError("the experts' fingerprints were never read from the checkpoint")
        return finish_fingerprint(self.hashes[e], self.mode)

    def subset(self, ids: list[int]) -> RoutedExperts:
        raise ValueError("a model loaded without its routed experts has no expert weights to serve")

    def quantized(self, mode: str) -> ExpertFingerprints:
        """The same experts as the servers hold them in format `mode` (what `QuantizedExperts`
        would be)."""
        out = ExpertFingerprints(self.num_experts, self.hidden_size, self._dtype, mode)
        out.hashes = self.hashes
        return out


def leave_out_routed_experts(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every MoE block's routed experts by `ExpertFingerprints` (before the model's
    parameters are allocated: build on the meta device first); the number of blocks changed."""
    blocks = moe_blocks(model)
    for block in blocks:
        block.experts = ExpertFingerprints(block.num_experts, block.experts.hidden_size, dtype)
    return len(blocks)


def _quantised_linear(weight: torch.Tensor, mode: str, group_size: int) -> nn.Module:
    from tokenops.engine.quantize import (
        Bf16Linear,
        DynamicInt8Linear,
        Int4WeightOnlyLinear,
        Int8WeightOnlyLinear,
    )

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if mode == "int8":
        return Int8WeightOnlyLinear.from_linear(linear)
    if mode == "int8_dynamic":
        return DynamicInt8Linear.from_linear(linear)
    if mode == "int4":
        return Int4WeightOnlyLinear.from_linear(linear, group_size)
    if mode == "bf16":
        return Bf16Linear.from_linear(linear)
    raise ValueError(f"unknown quantization {mode!r} for the routed experts")


def quantize_experts(model: nn.Module, mode: str | None, group_size: int = 32) -> int:
    """Give every MoE block's routed experts the `mode` format (what `quantize.quantize_model`
    does for the linear layers); the number of blocks changed. None: no-op."""
    if mode is None:
        return 0
    changed = 0
    for block in moe_blocks(model):
        if isinstance(block.experts, Experts):
            block.experts = QuantizedExperts(block.experts, mode, group_size)
        elif isinstance(block.experts, ExpertFingerprints) and block.experts.mode is None:
            block.experts = block.experts.quantized(mode)  # the servers quantise; the client expects it
        else:
            continue
        changed += 1
    return changed


class TopKRouter(nn.Module):
    """Softmax over the experts in float32, the top k kept, renormalised to sum 1 when asked."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], gate weights [T, k] in x's dtype)."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


class GatedMLP(nn.Module):
    """SiLU(gate) * up -> down, gate|up fused: the dense layers and shared experts of MoE families."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the optional shared expert of one layer."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.moe
        assert spec is not None
        if config.hidden_act != "silu":
            raise ValueError(f"MoE experts support hidden_act 'silu', got {config.hidden_act!r}")
        self.layer_idx = layer_idx
        self.num_experts = spec.num_experts
        self.gate = TopKRouter(spec.num_experts, config.hidden_size, spec.top_k, spec.norm_topk_prob)
        self.experts = Experts(spec.num_experts, config.hidden_size, spec.expert_intermediate_size)
        self.shared_expert = (
            GatedMLP(config.hidden_size, spec.shared_expert_intermediate_size)
            if spec.shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False)
            if self.shared_expert is not None and spec.shared_expert_gate
            else None
        )
        # where the routed experts run; None: here, on self.experts
        self.dispatch: ExpertDispatch | None = None
        # tokens routed to each expert since start (k per token); a plain tensor, not a buffer, so
        # state_dict and dtype casts never see it (on the CPU whatever the model's device: read by /metrics)
        self.tokens_per_expert = torch.zeros(spec.num_experts, dtype=torch.int64, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        dispatch = self.dispatch or self.experts.forward
        return self.add_shared(x, dispatch(x, ids, weights))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids, gate weights) of each token, counted in `tokens_per_expert`."""
        ids, weights = self.gate.forward(x)
        self.tokens_per_expert += torch.bincount(ids.reshape(-1), minlength=self.num_experts).cpu()
        return ids, weights

    def add_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus the shared expert's, where the family has one."""
        shared = self.shared_output(x)
        return routed if shared is None else routed + shared

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        shared = self.shared_expert.forward(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def expert_load(model: nn.Module) -> dict[str, list[int]]:
    """Tokens routed to each expert since start, keyed by layer index as a string (a JSON key; {} for
    a dense model): the input to expert placement and balancing."""
    return {str(b.layer_idx): b.tokens_per_expert.tolist() for b in moe_blocks(model)}
