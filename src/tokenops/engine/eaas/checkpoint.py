"""An expert server's share of an MoE checkpoint, read without loading the rest of it.

The safetensors headers of a Hugging Face folder name every tensor; only the held experts'
gate / up / down tensors are then read (memory-mapped, one at a time) and stacked per layer in the
compute dtype. Attention, embeddings, dense layers and the other experts are never read, so a
server's memory scales with its share of the experts. Checkpoints in transformers 5's fused layout
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) are sliced per expert.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch

from tokenops.engine.eaas.server import ExpertShard, checked_expert_ids, parse_expert_spec
from tokenops.engine.loader import text_weight_name
from tokenops.engine.models import ModelConfig, family_class
from tokenops.engine.models.moe import Experts
from tokenops.modelfiles.files import ModelNotFoundError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>gate_up_proj|down_proj)$")
_FUSED_PART = {"gate_up_proj": "gate_up", "down_proj": "down"}

# (file, key, the expert's row of a fused tensor or None for a per-expert one)
_Location = tuple[Path, str, int | None]


def read_expert_shard(folder: Path, experts: str, dtype: torch.dtype = torch.float32) -> ExpertShard:
    """The experts `experts` names (`parse_expert_spec`'s syntax) of the HF folder `folder`."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json, so it is not a Hugging Face model folder")
    config = ModelConfig.from_hf_config(json.loads(cfg_path.read_text(encoding="utf-8")))
    if config.moe is None:
        raise ValueError(f"{folder} has no MoE layers")
    family = family_class(config.architecture)
    moe_layers = [i for i, sparse in enumerate(config.moe.sparse_layers) if sparse]
    num_experts = config.moe.num_experts
    held = {
        layer: checked_expert_ids(layer, ids, moe_layers, num_experts)
        for layer, ids in parse_expert_spec(experts, moe_layers, num_experts).items()
    }
    if not held:
        raise ValueError("an expert server must hold at least one expert")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
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
                elif m := _FUSED.match(name):
                    layer = _layer_of(m["prefix"])
                    for expert in held.get(layer, ()):
                        where[(layer, expert, _FUSED_PART[m["part"]])] = (file, key, expert)
    return where


def _layer_of(prefix: str) -> int:
    m = _LAYER.search(prefix)
    return int(m[1]) if m else -1
