"""The routed experts of an MoE checkpoint, read on their own: an expert server's share of them, and
the fingerprints an attention client checks its servers against.

The safetensors headers of a Hugging Face folder name every tensor; `read_expert_shard` then reads
only the held experts' gate / up / down tensors (memory-mapped, one at a time) and stacks them per
layer in the compute dtype, so a server's memory scales with its share of the experts. Checkpoints
in transformers 5's fused layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])
are sliced per expert. `read_expert_hashes` streams every expert's bytes through its fingerprint
hash in small chunks with plain reads (no memory map, no whole tensor), which is how a client
that holds no expert weights still knows what its servers must hold. A GGUF file's 3-D
`ffn_{gate,up,down}_exps` tensors are read the same way, one expert's rows at a time (through the
file's memory map, dequantised per slice).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import torch

from tokenops.engine.eaas.server import ExpertShard, checked_expert_ids, parse_expert_spec
from tokenops.engine.gguf_reader import GGUFExperts, read_gguf_experts
from tokenops.engine.loader import text_weight_name
from tokenops.engine.models import ModelConfig, family_class
from tokenops.engine.models.moe import Experts, expert_hasher
from tokenops.engine.models.moe_decoder import FUSED_EXPERTS
from tokenops.modelfiles.files import ModelNotFoundError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
_FUSED_PART = {"gate_up_proj": "gate_up", "down_proj": "down"}

# (file, key, the expert's row of a fused tensor or None for a per-expert one)
_Location = tuple[Path, str, int | None]


def read_expert_shard(source: Path, experts: str, dtype: torch.dtype = torch.float32) -> ExpertShard:
    """The experts `experts` names (`parse_expert_spec`'s syntax) of the HF folder or GGUF file
    `source`."""
    source = Path(source)
    gguf = read_gguf_experts(source) if source.is_file() else None
    config = _moe_config(source, gguf)
    assert config.moe is not None
    moe_layers = [i for i, sparse in enumerate(config.moe.sparse_layers) if sparse]
    num_experts = config.moe.num_experts
    held = {
        layer: checked_expert_ids(layer, ids, moe_layers, num_experts)
        for layer, ids in parse_expert_spec(experts, moe_layers, num_experts).items()
    }
    if not held:
        raise ValueError("an expert server must hold at least one expert")
    if gguf is not None:
        return _gguf_shard(gguf, held, dtype)
    folder = source
    family = family_class(config.architecture)
    files = _weight_files(folder)
    where = _locate(files, family, held)
    layers = {}
    with ExitStack() as stack:
        from safetensors import safe_open

        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in files}

        def read(layer: int, expert: int, part: str) -> torch.Tensor:
            loc = where.get((layer, expert, part))
            if loc is None:
                raise ValueError(f"checkpoint lacks weights: layer {layer} expert {expert} has no {part}")
            file, key, row = loc
            if row is None:
                return handles[file].get_tensor(key).to(dtype)
            return handles[file].get_slice(key)[row : row + 1][0].to(dtype)

        for layer, ids in held.items():
            gate_up = [
                read(layer, e, "gate_up")
                if (layer, e, "gate_up") in where
                else torch.cat([read(layer, e, "gate"), read(layer, e, "up")])
                for e in ids
            ]
            try:
                stacked = torch.stack(gate_up), torch.stack([read(layer, e, "down") for e in ids])
            except RuntimeError as err:  # shapes that do not stack
                raise ValueError(f"expert weights of layer {layer} do not fit together: {err}") from None
            layers[layer] = (Experts.of(*stacked), ids)
    return ExpertShard(layers)


def _gguf_shard(gguf: GGUFExperts, held: dict[int, list[int]], dtype: torch.dtype) -> ExpertShard:
    """The held experts of a GGUF file: only their slices of the 3-D expert tensors are read."""
    layers = {}
    for layer, ids in held.items():
        gate_up = [torch.cat([gguf.weight(layer, e, "gate"), gguf.weight(layer, e, "up")]) for e in ids]
        down = [gguf.weight(layer, e, "down") for e in ids]
        try:
            stacked = torch.stack(gate_up).to(dtype), torch.stack(down).to(dtype)
        except RuntimeError as err:  # shapes that do not stack
            raise ValueError(f"expert weights of layer {layer} do not fit together: {err}") from None
        layers[layer] = (Experts.of(*stacked), ids)
    return ExpertShard(layers)


def read_expert_hashes(source: Path, dtype: torch.dtype = torch.float32) -> dict[int, list[hashlib.blake2b]]:
    """Per MoE layer of the HF folder or GGUF file `source`, every expert's
    `models.moe.expert_hasher` fed its weights as a model in `dtype` holds them; at most about
    `_CHUNK` bytes of them in memory at a time."""
    source = Path(source)
    gguf = read_gguf_experts(source) if source.is_file() else None
    config = _moe_config(source, gguf)
    assert config.moe is not None
    every = list(range(config.moe.num_experts))
    held = {i: every for i, sparse in enumerate(config.moe.sparse_layers) if sparse}
    if gguf is not None:
        return {layer: [_gguf_hash(gguf, layer, e, dtype) for e in ids] for layer, ids in held.items()}
    folder = source
    family = family_class(config.architecture)
    files = _weight_files(folder)
    where = _locate(files, family, held)
    index = {f: _safetensors_index(f) for f in files}
    out: dict[int, list[hashlib.blake2b]] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(open(f, "rb")) for f in files}  # noqa: SIM115 - closed by the stack
        for layer, ids in held.items():
            hashes = []
            for e in ids:
                h = expert_hasher()
                parts = ["gate_up"] if (layer, e, "gate_up") in where else ["gate", "up"]
                for part in [*parts, "down"]:
                    loc = where.get((layer, e, part))
                    if loc is None:
                        raise ValueError(f"checkpoint lacks weights: layer {layer} expert {e} has no {part}")
                    file, key, row = loc
                    _feed(h, handles[file], index[file][key], row, dtype)
                hashes.append(h)
            out[layer] = hashes
    return out


def _gguf_hash(gguf: GGUFExperts, layer: int, expert: int, dtype: torch.dtype) -> hashlib.blake2b:
    h = expert_hasher()
    for part in ("gate", "up", "down"):
        rows = gguf.rows(layer, part)
        step = max(1, _CHUNK // (4 * int(gguf.tensors[(layer, part)].shape[0])))
        for start in range(0, rows, step):
            w = gguf.weight(layer, expert, part, slice(start, start + step))
            h.update(w.to(dtype).float().numpy().tobytes())
    return h


def _moe_config(source: Path, gguf: GGUFExperts | None = None) -> ModelConfig:
    if gguf is not None:
        config = ModelConfig.from_hf_config(gguf.hf_config)
    else:
        cfg_path = source / "config.json"
        if not cfg_path.is_file():
            raise ModelNotFoundError(f"{source} has no config.json, so it is not a Hugging Face model folder")
        config = ModelConfig.from_hf_config(json.loads(cfg_path.read_text(encoding="utf-8")))
    if config.moe is None:
        raise ValueError(f"{source} has no MoE layers")
    return config


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    return files


# safetensors dtype names torch can read; bytes hashed at a time
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_CHUNK = 1 << 22

# (dtype name, shape, first byte, end byte) of a tensor in its file
_Extent = tuple[str, list[int], int, int]


def _safetensors_index(file: Path) -> dict[str, _Extent]:
    """Where each tensor's bytes are in a safetensors file (an 8-byte header length, a JSON header)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    return {
        key: (info["dtype"], info["shape"], base + info["data_offsets"][0], base + info["data_offsets"][1])
        for key, info in header.items()
        if key != "__metadata__"
    }


def _feed(h: hashlib.blake2b, f: BinaryIO, extent: _Extent, row: int | None, dtype: torch.dtype) -> None:
    """Hash a tensor's (or, `row` given, its row `row`'s) values as float32 of `dtype`, chunk by chunk."""
    name, shape, begin, end = extent
    stored = _ST_DTYPES.get(name)
    if stored is None:
        raise ValueError(f"expert weights stored as {name} are not supported")
    if row is not None:
        size = (end - begin) // shape[0]
        begin, end = begin + row * size, begin + (row + 1) * size
    step = _CHUNK - _CHUNK % stored.itemsize
    f.seek(begin)
    while begin < end:
        raw = bytearray(f.read(min(step, end - begin)))
        if not raw:
            raise ValueError(f"{f.name} is cut off inside a tensor")
        h.update(torch.frombuffer(raw, dtype=stored).to(dtype).float().numpy().tobytes())
        begin += len(raw)


def _locate(
    files: list[Path], family: type, held: dict[int, list[int]]
) -> dict[tuple[int, int, str], _Location]:
    """(layer, expert, gate | up | down | gate_up) -> where that tensor is, for the held experts only."""
    from safetensors import safe_open

    where: dict[tuple[int, int, str], _Location] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = text_weight_name(key)
                if name is None:
                    continue
                name = family.renamed(name)
                found = family.expert_tensor(name)
                if found is not None:
                    prefix, expert, part = found
                    layer = _layer_of(prefix)
                    if expert in held.get(layer, ()):
                        where[(layer, expert, part)] = (file, key, None)
                elif m := FUSED_EXPERTS.match(name):
                    layer = _layer_of(m["prefix"])
                    for expert in held.get(layer, ()):
                        where[(layer, expert, _FUSED_PART[m["part"]])] = (file, key, expert)
    return where


def _layer_of(prefix: str) -> int:
    m = _LAYER.search(prefix)
    return int(m[1]) if m else -1
