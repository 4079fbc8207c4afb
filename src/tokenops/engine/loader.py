"""Turn a model spec (bundled name, HF folder or .gguf file) into a ready model and tokenizer.

`load_model` resolves the spec (`modelfiles.files.resolve_model`, which the gateway's prompt tokeniser
calls too, so both read the same file), reads the config and tokenizer, builds the family's module with
`build_model` and streams the weights into it in the requested dtype. GGUF specifics (metadata,
tensor names, the dequantisation cache) live in `gguf_reader`; bundled names in `modelfiles.bundled`. With
`gguf_native=True` a GGUF model's linear layers are built as int4 straight from the file's 4-bit
blocks (`gguf_quant`). The engine core never reads files itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenops.engine.gguf_quant import install_int4_experts, install_int4_linears
from tokenops.engine.gguf_reader import read_gguf
from tokenops.engine.models import CausalLM, ModelConfig, build_model
from tokenops.engine.models.moe import moe_blocks
from tokenops.modelfiles.bundled import DEFAULT_MODEL
from tokenops.modelfiles.files import ModelNotFoundError, default_cache_dir, resolve_model
from tokenops.modelfiles.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFoundError", "load_model"]

# prefixes of multimodal checkpoints whose text model we can serve; other towers are skipped
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIP_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    # how the load went: seconds per phase (read_s includes tokenizer_s), and whether the GGUF cache
    # was used (gguf_native: the native entry, with config, tokenizer and the linears quantised at load)
    load_stats: dict[str, float | bool | str] = field(default_factory=dict)


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    gguf_native: bool = False,
    routed_experts: bool = True,
) -> LoadedModel:
    """Load `spec`: a bundled name ("smollm2-135m-instruct", "gemma-3-270m"), a HF folder, or a .gguf file.

    `gguf_native`: every linear layer becomes a group-32 `Int4WeightOnlyLinear`, taken from the
    file's Q4_0 / Q4_1 / Q4_K blocks as they are and quantised at load time from the other types;
    GGUF models only. `routed_experts=False` (an engine whose experts run on expert servers): the
    MoE blocks' routed experts are never loaded, only fingerprinted (`moe.ExpertFingerprints`)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = resolve_model(spec, cache_dir)
    if source.kind == "gguf":
        return _load_gguf(source.name, source.path, device, dtype, cache_dir, gguf_native, routed_experts)
    if gguf_native:
        raise ValueError(f"gguf_native needs a GGUF model, and {source.path} is a Hugging Face folder")
    return _load_hf_folder(source.name, source.path, device, dtype, routed_experts)


def _load_gguf(
    name: str,
    path: Path,
    device: str,
    dtype: torch.dtype,
    cache_dir: Path,
    gguf_native: bool = False,
    routed_experts: bool = True,
) -> LoadedModel:
    t0 = time.perf_counter()
    gguf = read_gguf(path, cache_dir, int4_blocks=gguf_native, routed_experts=routed_experts)
    t1 = time.perf_counter()
    config = ModelConfig.from_hf_config(gguf.hf_config)
    if gguf.rope_freq_factors is not None:
        config = config.with_overrides(rope_freq_factors=gguf.rope_freq_factors)
    routed_experts = routed_experts or config.moe is None
    model = build_model(config, dtype=dtype, device=device, routed_experts=routed_experts)
    # native: the tensors are read (and blocks converted) lazily, so "build" includes that work;
    # routed experts become int4 experts, not float ones
    if gguf_native:
        model.load_weights(install_int4_linears(model, install_int4_experts(model, gguf.weights)))
    else:
        model.load_weights(gguf.weights)
    if not routed_experts:
        _fingerprint_experts(model, path, dtype)
    t2 = time.perf_counter()
    stats = {
        "read_s": round(t1 - t0, 3),
        "tokenizer_s": round(gguf.tokenizer_s, 3),
        "build_s": round(t2 - t1, 3),
        "from_cache": gguf.from_cache,
        "sha256": gguf.sha256,
        "gguf_native": gguf_native,
    }
    return LoadedModel(
        name=name, path=path, config=config, model=model, tokenizer=gguf.tokenizer, load_stats=stats
    )


def _load_hf_folder(
    name: str, folder: Path, device: str, dtype: torch.dtype, routed_experts: bool = True
) -> LoadedModel:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json, so it is not a Hugging Face model folder")
    t0 = time.perf_counter()
    config = ModelConfig.from_hf_config(json.loads(cfg_path.read_text(encoding="utf-8")))
    tokenizer = Tokenizer.from_hf_folder(folder)
    if not tokenizer.eos_token_ids and config.eos_token_ids:
        tokenizer.eos_token_ids = list(config.eos_token_ids)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{folder} has no *.safetensors weights (.bin checkpoints are not supported)"
        )
    routed_experts = routed_experts or config.moe is None
    model = build_model(config, dtype=dtype, device=device, routed_experts=routed_experts)
    if routed_experts:
        model.load_weights(_safetensors_weights(files))
    else:
        model.load_weights(_safetensors_weights(files, skip=type(model).is_routed_expert))
        _fingerprint_experts(model, folder, dtype)
    stats = {"build_s": round(time.perf_counter() - t0, 3), "from_cache": False}
    return LoadedModel(
        name=name, path=folder, config=config, model=model, tokenizer=tokenizer, load_stats=stats
    )


def _fingerprint_experts(model: CausalLM, source: Path, dtype: torch.dtype) -> None:
    """Give a model loaded without its routed experts their fingerprints, read from `source`."""
    from tokenops.engine.eaas.checkpoint import read_expert_hashes

    hashes = read_expert_hashes(source, dtype)
    for block in moe_blocks(model):
        block.experts.hashes = hashes[block.layer_idx]


def _safetensors_weights(
    files: list[Path], skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors; those `skip` names are not read at all."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = text_weight_name(key)
                if name is not None and not (skip is not None and skip(name)):
                    yield name, f.get_tensor(key)


def text_weight_name(key: str) -> str | None:
    """A checkpoint key as the text model names it; None for another tower's (vision, projector)."""
    if key.startswith(_SKIP_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return replacement + key[len(prefix) :]
    return key
