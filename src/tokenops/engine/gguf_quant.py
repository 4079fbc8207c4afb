"""GGUF 4-bit blocks used as they are: `int4_blocks` turns llama.cpp's Q4_0, Q4_1 and Q4_K tensors
(group-32 int4 codes with a float scale and offset per group) into the codes, scales and zeros that
`quantize.Int4WeightOnlyLinear` runs on (w = (code - 8) * scale + zero) with a few vectorised torch
ops, reproducing `gguf.quants.dequantize` up to float32 rounding; `install_int4_linears` builds a
model's linear layers (fused q|k|v and gate|up included) from them, `install_int4_experts` an MoE
model's routed experts, and `quantised_blocks` quantises the parts whose GGUF type has no int4
form. `TORCH_DEQUANTIZERS` (Q8_0, Q5_0) dequantise to float32 bit-equal to gguf-py. Reading the
file is `gguf_reader`'s job; choosing the mode is the engine config's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenops.engine.models.layers import MergedLinear
from tokenops.engine.quantize import Int4WeightOnlyLinear, dequantize_int4, quantize_int4

__all__ = [
    "GROUP_SIZE",
    "INT4_TYPE_NAMES",
    "TORCH_DEQUANTIZERS",
    "Int4Blocks",
    "dequantize_q5_0",
    "dequantize_q8_0",
    "install_int4_experts",
    "install_int4_linears",
    "int4_blocks",
    "quantised_blocks",
]

GROUP_SIZE = 32  # every 4-bit GGUF type has 32-weight groups (Q4_K: sub-blocks of its 256 super-blocks)
INT4_TYPE_NAMES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


@dataclass
class Int4Blocks:
    """One [out, in] weight as int4 codes (uint8 0..15) with float32 scale and zero per 32 inputs."""

    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, in / 32]
    zeros: torch.Tensor  # float32 [out, in / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def map_rows(self, fn) -> Int4Blocks:
        """The same weight with its rows reordered by `fn` (a function of an [out, ...] tensor)."""
        return Int4Blocks(
            fn(self.codes).contiguous(), fn(self.scales).contiguous(), fn(self.zeros).contiguous()
        )

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.codes, self.scales, self.zeros)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _bytes(data: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memmap of the file: only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1))


def _blocks_of(data: np.ndarray, shape: tuple[int, ...], type_name: str, nbytes: int) -> torch.Tensor:
    raw = _bytes(data)
    n = int(np.prod(shape))
    if n % 32 or raw.numel() != n // 32 * nbytes:
        raise ValueError(
            f"{type_name} tensor of shape {shape} should hold {n // 32 * nbytes} bytes, not {raw.numel()}"
        )
    return raw.view(-1, nbytes)


def dequantize_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 (34-byte blocks of 32: fp16 d, 32 int8) -> float32 d * q: the same float32 products as
    `gguf.quants.dequantize` in a few torch ops (numpy's took 17 s for Gemma's 168M-entry
    embedding table on the loaded 2-core machine, this 0.7 s)."""
    b = _blocks_of(data, shape, "Q8_0", 34)
    return (b[:, 2:].view(torch.int8).float() * _fp16(b[:, :2])).view(shape)


def dequantize_q5_0(data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q5_0 (22-byte blocks of 32: fp16 d, 32 high bits as a little-endian uint32, 16 bytes of low
    nibbles: first 16 weights low, last 16 high) -> float32 d * (q - 16), as `gguf.quants`."""
    b = _blocks_of(data, shape, "Q5_0", 22)
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((b[:, 2:6, None] >> shifts) & 1).reshape(-1, 32)  # bit j of the uint32 = weight j
    qs = b[:, 6:]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    q = (low | (high << 4)).to(torch.int8) - 16
    return (q.float() * _fp16(b[:, :2])).view(shape)


# GGUF types whose dequantisation runs in torch here rather than in gguf-py's numpy (bit-equal)
TORCH_DEQUANTIZERS = {"Q8_0": dequantize_q8_0, "Q5_0": dequantize_q5_0}


def int4_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    """Codes, scales and zeros of a GGUF tensor of type Q4_0 / Q4_1 / Q4_K.

    `data` is the tensor's raw bytes (any shape; rows of blocks as the file stores them), `shape`
    its [out, in] weight shape (GGUF lists dims the other way round). The layouts:
    - Q4_0 (18-byte blocks of 32: fp16 d, 16 bytes of nibbles): w = d * (q - 8) -> scale d, zero 0
    - Q4_1 (20 bytes: fp16 d, fp16 m, nibbles): w = d * q + m -> scale d, zero m + 8d
    - Q4_K (144-byte super-blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for
      8 sub-blocks of 32, 128 bytes of nibbles): w = d*sc * q - dmin*mn -> scale d*sc, zero 8*d*sc - dmin*mn
    In Q4_0/Q4_1 a block's low nibbles are its first 16 weights and the high nibbles the last 16; in
    Q4_K each 32-byte chunk holds two sub-blocks (low nibbles the first, high nibbles the second).
    """
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} has no int4 form (only {', '.join(INT4_TYPE_NAMES)})")
    block, nbytes = _BLOCK_BYTES[type_name]
    out_f, in_f = shape
    if in_f % block:
        raise ValueError(
            f"a {type_name} row of {in_f} weights is not a whole number of {block}-weight blocks"
        )
    raw = _bytes(data)
    if raw.numel() != out_f * in_f // block * nbytes:
        raise ValueError(
            f"{type_name} tensor of shape {shape} should hold {out_f * in_f // block * nbytes} bytes, "
            f"not {raw.numel()}"
        )
    b = raw.view(out_f, in_f // block, nbytes)
    if type_name == "Q4_K":
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        s = b[..., 4:16].view(out_f, -1, 3, 4)  # [d-bytes 0..3, m-bytes 4..7, high-bits bytes 8..11]
        lo, hi, mixed = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
        mn = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], dim=-1).float()
        scales = d * sc  # [out, supers, 8]
        zeros = 8 * scales - dmin * mn
        qs = b[..., 16:].view(out_f, -1, 4, 1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-2)  # [out, supers, 4, 2, 32]: sub-block 2j, 2j+1
    else:
        d = _fp16(b[..., 0:2])
        scales = d
        zeros = torch.zeros_like(d) if type_name == "Q4_0" else _fp16(b[..., 2:4]) + 8 * d
        qs = b[..., nbytes - 16 :]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # first 16 weights, then the last 16
    return Int4Blocks(
        codes.reshape(out_f, in_f).contiguous(),
        scales.reshape(out_f, -1).contiguous(),
        zeros.reshape(out_f, -1).contiguous(),
    )


def _linear_target(name: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int, str]:
    """HF tensor name -> (our module name, shard index, "weight" | "bias"), following `stacked`."""
    for hf_part, (our_part, shard) in stacked.items():
        if hf_part in name:
            module, _, kind = name.replace(hf_part, our_part).rpartition(".")
            return module, shard, kind
    module, _, kind = name.rpartition(".")
    return module, 0, kind


def install_int4_linears(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | Int4Blocks]]
) -> list[tuple[str, torch.Tensor]]:
    """Replace every linear layer of `model` (not an untied lm_head) by an `Int4WeightOnlyLinear`.

    `weights` yields HF-named tensors, `Int4Blocks` for those the file holds as 4-bit blocks. A
    linear's parts are taken as they are when they are blocks and quantised (group 32) otherwise,
    then concatenated in shard order. Returns the remaining tensors, for `model.load_weights`
    (blocks that belong to no linear layer come back dequantised).
    """
    linears = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] != "lm_head"
    }
    stacked = getattr(model, "stacked_params", {})
    parts: dict[str, dict[int, torch.Tensor | Int4Blocks]] = {name: {} for name in linears}
    biases: dict[str, dict[int, torch.Tensor]] = {name: {} for name in linears}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        module, shard, kind = _linear_target(name, stacked)
        if module in linears and kind in ("weight", "bias"):
            (parts if kind == "weight" else biases)[module][shard] = tensor
        else:
            rest.append((name, tensor.dequantize() if isinstance(tensor, Int4Blocks) else tensor))
    for name, linear in linears.items():
        sizes = linear.shard_sizes if isinstance(linear, MergedLinear) else [linear.out_features]
        missing = [i for i in range(len(sizes)) if i not in parts[name]]
        if missing:
            raise ValueError(f"checkpoint lacks weights of {name} (shards {missing})")
        blocks = [
            _as_int4(f"{name}#{i}", parts[name][i], (sizes[i], linear.in_features)) for i in range(len(sizes))
        ]
        bias = None
        if biases[name]:
            if len(biases[name]) != len(sizes):
                raise ValueError(f"checkpoint has biases for only some parts of {name}")
            bias = torch.cat([biases[name][i] for i in range(len(sizes))]).to(linear.weight.dtype)
        device = linear.weight.device
        new = Int4WeightOnlyLinear(
            torch.cat([b.codes for b in blocks]).to(device),
            torch.cat([b.scales for b in blocks]).to(device),
            torch.cat([b.zeros for b in blocks]).to(device),
            linear.in_features,
            None if bias is None else bias.to(device),
            linear.weight.dtype,
        )
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    return rest


def install_int4_experts(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | Int4Blocks]]
) -> Iterator[tuple[str, torch.Tensor | Int4Blocks]]:
    """`weights` passed through, less the routed experts' (one weight per expert: `Int4Blocks`
    where the file has 4-bit blocks, float otherwise), from which each MoE layer's experts become
    int4 `QuantizedExperts` as soon as all of them are read: an MoE file stays 4-bit in memory."""
    from tokenops.engine.models.moe import moe_blocks

    blocks = {b.layer_idx: b for b in moe_blocks(model)}
    if not blocks:
        yield from weights
        return
    family = type(model)
    num_experts = next(iter(blocks.values())).num_experts
    pending: dict[int, dict[tuple[int, str], torch.Tensor | Int4Blocks]] = {}
    for name, tensor in weights:
        found = family.expert_tensor(family.renamed(name))
        if found is None:
            yield name, tensor
            continue
        prefix, expert, part = found
        layer = int(prefix.split(".layers.")[1].split(".")[0])
        if layer not in blocks or expert >= num_experts:
            raise ValueError(f"the model has no routed expert {expert} in layer {layer} ({name})")
        parts = pending.setdefault(layer, {})
        parts[(expert, part)] = tensor
        if len(parts) == 3 * num_experts:
            block = blocks[layer]
            block.experts = _int4_experts(pending.pop(layer), num_experts, block.experts.dtype)
    for layer in pending:
        have = sorted({e for e, _ in pending[layer]})
        raise ValueError(f"checkpoint lacks weights: layer {layer} has expert tensors of {have[:8]} only")


def _int4_experts(
    parts: dict[tuple[int, str], torch.Tensor | Int4Blocks], num_experts: int, dtype: torch.dtype
) -> nn.Module:
    from tokenops.engine.models.moe import QuantizedExperts, expert_hasher, finish_fingerprint

    gate_up, down, fingerprints = [], [], []
    for e in range(num_experts):
        h = expert_hasher()
        layers = []
        for label, pieces in ((f"expert {e} gate|up", ("gate", "up")), (f"expert {e} down", ("down",))):
            blocks = _expert_blocks(label, [parts[(e, p)] for p in pieces])
            for t in (blocks.codes, blocks.scales, blocks.zeros):
                h.update(t.contiguous().numpy().tobytes())
            layers.append(Int4WeightOnlyLinear(blocks.codes, blocks.scales, blocks.zeros, blocks.in_features))
        gate_up.append(layers[0])
        down.append(layers[1])
        # the file's blocks, not float weights: only an engine reading the same file matches them
        fingerprints.append(finish_fingerprint(h, "gguf_int4"))
    return QuantizedExperts.of(gate_up, down, "int4", fingerprints, dtype)


@dataclass
class _ExpertBlocks:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    in_features: int


def _expert_blocks(label: str, pieces: list[torch.Tensor | Int4Blocks]) -> _ExpertBlocks:
    """One expert projection (gate and up stacked) as int4: the file's blocks where every piece
    has them, else quantised here (group 32, the input padded as `quantize_int4` does)."""
    if all(isinstance(p, Int4Blocks) for p in pieces):
        return _ExpertBlocks(
            torch.cat([p.codes for p in pieces]),
            torch.cat([p.scales for p in pieces]),
            torch.cat([p.zeros for p in pieces]),
            pieces[0].shape[1],
        )
    weight = torch.cat([p.dequantize() if isinstance(p, Int4Blocks) else p for p in pieces])
    if weight.dim() != 2:
        raise ValueError(f"{label}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    return _ExpertBlocks(*quantize_int4(weight.float(), GROUP_SIZE), weight.shape[1])


def _as_int4(label: str, part: torch.Tensor | Int4Blocks, shape: tuple[int, int]) -> Int4Blocks:
    if tuple(part.shape) != shape:
        raise ValueError(f"weight {label} has shape {tuple(part.shape)}, expected {shape}")
    return part if isinstance(part, Int4Blocks) else quantised_blocks(label, part)


def quantised_blocks(label: str, weight: torch.Tensor) -> Int4Blocks:
    """A float [out, in] weight quantised at load time (group 32, `quantize.quantize_int4`)."""
    if weight.shape[1] % GROUP_SIZE:  # quantize_int4 would pad; the fused layer needs one common width
        raise ValueError(
            f"weight {label}: {weight.shape[1]} inputs is not a multiple of the int4 group ({GROUP_SIZE})"
        )
    return Int4Blocks(*quantize_int4(weight, GROUP_SIZE))
