"""GGUF files (llama.cpp's format) read into what the loader needs: `read_gguf` returns the HF-style
config dict, the `Tokenizer` and the weights as float32 tensors under Hugging Face names, with
llama.cpp's conversions undone (Llama's Q/K row permutation, Gemma's norms stored as 1 + w). The
dequantised weights are cached on disk under `<cache_dir>/gguf/<sha256>-v<format>/`, written into a
temporary folder and renamed into place so a crash never leaves a half-written entry; with
`int4_blocks=True` (the `gguf_native` mode) linear weights come back as `gguf_quant.Int4Blocks`
and the converted ones are cached in `<sha>-v<format>-int4/`, checked by their sha256. Entries that
hold a tokenizer.json of their own feed the tokenizer cache when its entry is missing
(`_legacy_tokenizers`). The header parser, file hash and tokenizer cache live in the torch-free
`tokenops.modelfiles`; the 4-bit block layouts in `gguf_quant`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenops.engine.gguf_quant import INT4_TYPE_NAMES, TORCH_DEQUANTIZERS, Int4Blocks, quantised_blocks
from tokenops.engine.gguf_quant import int4_blocks as to_int4_blocks
from tokenops.modelfiles.files import GGUFHeader, GGUFTensor, default_cache_dir, file_sha256, gguf_tokenizer
from tokenops.modelfiles.tokenizer import Tokenizer

__all__ = ["CACHE_FORMAT", "GGUFModel", "read_gguf"]

# bump when the cached names or conversions change (the -int4 entry: also `quantize_int4`'s rounding)
CACHE_FORMAT = 1

# per-block llama.cpp tensor name -> HF sub-name (under model.layers.N.)
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# MoE layers (Mixtral is written as "llama" with an expert count): the router, the routed experts
# as 3-D [experts, out, in] tensors, split into per-expert weights on reading ({e}), and the shared
# expert with its sigmoid gate (Qwen2-MoE)
_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_MAPS = {
    "llama": {**_LLAMA_BLOCK, **_MOE_BLOCK},
    "gemma3": _GEMMA3_BLOCK,
    "qwen2moe": {**_LLAMA_BLOCK, **_MOE_BLOCK},
    "qwen3moe": {**_LLAMA_BLOCK, **_MOE_BLOCK, **_QK_NORM},
}
# llama.cpp architecture -> HF model_type (the "llama" of a file with experts is Mixtral)
_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass
class GGUFModel:
    """A GGUF file read into engine terms; `weights` yields (HF name, float32 tensor) once, or
    `Int4Blocks` in place of the tensor for linear weights read with `int4_blocks=True`."""

    path: Path
    sha256: str
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, torch.Tensor | Int4Blocks]]
    rope_freq_factors: tuple[float, ...] | None
    from_cache: bool
    tokenizer_s: float = 0.0  # seconds spent getting the tokenizer (from its cache, or rebuilt)


def read_gguf(
    path: Path,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    int4_blocks: bool = False,
    routed_experts: bool = True,
) -> GGUFModel:
    """Config, tokenizer and HF-named float32 weights of a GGUF file, from the cache when it has them.

    `int4_blocks`: every linear weight comes back as `Int4Blocks`, 4-bit ones read from the file
    itself, the others from the native (-int4) entry, never from or into the float cache; routed
    experts stored in 4-bit types come back as one `Int4Blocks` per expert too.
    `routed_experts=False`: the MoE layers' routed-expert tensors are not read at all (and no float
    cache entry is written: it would lack them)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    sha = file_sha256(path)
    cache_dir = cache_dir or default_cache_dir()
    entry = cache_dir / "gguf" / f"{sha}-v{CACHE_FORMAT}"
    if int4_blocks:
        return _read_int4(path, sha, cache_dir, entry if use_cache else None, routed_experts)
    if use_cache and (entry / "model.json").is_file():
        return _read_cache_entry(path, sha, cache_dir, entry, routed_experts)

    header = GGUFHeader(path, vocabulary=False)  # the vocabulary is decoded only if the tokenizer is rebuilt
    t0 = time.perf_counter()
    tokenizer = gguf_tokenizer(path, cache_dir, header, use_cache=use_cache, legacy=_legacy_tokenizers(entry))
    tokenizer_s = time.perf_counter() - t0
    meta, tensors = _config_meta(header), header.tensors()
    hf_config = gguf_to_hf_config(meta, [t.name for t in tensors])
    weights: dict[str, torch.Tensor] = {}
    freq_factors = None
    arch = meta["general.architecture"]
    for name, tensor in _dequantised(tensors, hf_config, arch, routed_experts=routed_experts):
        if name == "rope_freqs":
            freq_factors = tuple(float(x) for x in tensor.tolist())
        else:
            weights[name] = tensor
    if use_cache and routed_experts:
        try:
            _write_cache_entry(entry, path, sha, hf_config, weights, freq_factors)
        except Exception as exc:  # noqa: BLE001 - the weights are read: a cache that cannot be written (OSError,
            # safetensors' SafetensorError) costs the next start only
            warnings.warn(f"could not write the GGUF cache entry {entry}: {exc}", stacklevel=2)
    return GGUFModel(
        path=path,
        sha256=sha,
        hf_config=hf_config,
        tokenizer=tokenizer,
        weights=iter(weights.items()),
        rope_freq_factors=freq_factors,
        from_cache=False,
        tokenizer_s=tokenizer_s,
    )


def _read_int4(
    path: Path, sha: str, cache_dir: Path, entry: Path | None, routed_experts: bool = True
) -> GGUFModel:
    native = None if entry is None else entry.with_name(entry.name + "-int4")
    cached = None if native is None else _read_int4_entry(native)
    # one walk of the header; the vocabulary's strings are decoded only if the tokenizer is rebuilt
    header = GGUFHeader(path, vocabulary=False)
    t0 = time.perf_counter()
    tokenizer = gguf_tokenizer(
        path, cache_dir, header, use_cache=entry is not None, legacy=_legacy_tokenizers(entry)
    )
    tokenizer_s = time.perf_counter() - t0
    meta, tensors = header.meta, header.tensors()
    arch = meta["general.architecture"]
    freq = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    freq_factors = None if freq is None else tuple(float(x) for x in np.asarray(freq.data).tolist())
    tensors = [t for t in tensors if t is not freq]
    if cached is not None:
        hf_config, blocks = cached
        weights = _with_cached_blocks(tensors, hf_config, arch, blocks, routed_experts)
    else:
        hf_config = gguf_to_hf_config(_config_meta(header), [t.name for t in tensors])
        weights = _dequantised(tensors, hf_config, arch, int4_blocks=True, routed_experts=routed_experts)
        if native is not None:
            converted = {hf_tensor_name(t.name, arch) for t in tensors if _converts_to_int4(t, arch)}
            weights = _caching_int4(weights, converted, native, path, sha, hf_config, freq_factors)
    return GGUFModel(
        path=path,
        sha256=sha,
        hf_config=hf_config,
        tokenizer=tokenizer,
        weights=weights,
        rope_freq_factors=freq_factors,
        from_cache=cached is not None,
        tokenizer_s=tokenizer_s,
    )


def _legacy_tokenizers(entry: Path | None) -> list[Path]:
    """The tokenizer.json files that the float and native entries held before the tokenizer had its
    own cache (`modelfiles.files.gguf_tokenizer` reads them when its entry is missing)."""
    if entry is None:
        return []
    return [entry / "tokenizer.json", entry.with_name(entry.name + "-int4") / "tokenizer.json"]


# --- metadata -----------------------------------------------------------------------------------


def _config_meta(header: GGUFHeader) -> dict[str, Any]:
    """What `gguf_to_hf_config` reads: scalar keys, and the token list only where the file does not
    state its vocabulary size (decoded from the header already walked)."""
    arch = header.meta.get("general.architecture")
    return header.meta if header.meta.get(f"{arch}.vocab_size") is not None else header.vocabulary_meta()


def gguf_to_hf_config(meta: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """The Hugging Face config.json a GGUF file's metadata describes (only what our families read)."""
    arch = meta.get("general.architecture")
    if arch not in _BLOCK_MAPS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_BLOCK_MAPS))})"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    rot_dim = get("rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings ({rot_dim} of {head_dim} dims) are not supported")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    cfg: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0 if arch == "llama" else 1_000_000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 8192)),
        }
    if get("expert_count"):
        cfg.update(_moe_config(arch, get, tensor_names, cfg["num_hidden_layers"]))
    if arch == "gemma3":
        # llama.cpp's defaults for Gemma 3 when the file does not say: every 6th layer global, local
        # theta 10k, query scale from head_dim except for the 27B model (hidden / heads)
        cfg["sliding_window"] = int(get("attention.sliding_window", 4096))
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer: True = sliding
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            cfg["sliding_window_pattern"] = int(pattern)
        cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
        scale = get("attention.scale")
        is_27b = cfg["num_hidden_layers"] == 62
        if scale:
            cfg["query_pre_attn_scalar"] = float(scale) ** -2
        else:
            cfg["query_pre_attn_scalar"] = hidden // heads if is_27b else head_dim
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        softcap = get("final_logit_softcapping")
        if softcap:
            cfg["final_logit_softcapping"] = float(softcap)
    return cfg


def _moe_config(arch: str, get, tensor_names: list[str], num_layers: int) -> dict[str, Any]:
    """The expert fields of config.json; which layers are sparse is read off the tensor names."""
    experts, top_k = int(get("expert_count")), int(get("expert_used_count") or 2)
    if arch == "llama":
        return {"model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": top_k}
    names = set(tensor_names)
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" not in names]
    cfg = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "mlp_only_layers": dense,
        # llama.cpp renormalises Qwen3-MoE's top-k weights and never Qwen2-MoE's
        "norm_topk_prob": arch == "qwen3moe",
    }
    if arch == "qwen2moe":
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length") or 0)
    return cfg


# --- tensors ------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """HF parameter name of a llama.cpp tensor name; None for tensors with no HF counterpart."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        sub = _BLOCK_MAPS[arch].get(part)
        return None if sub is None else f"model.layers.{layer}.{sub}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    return None


# linear-layer weights, the only tensors `int4_blocks=True` leaves as blocks
_LINEAR_RE = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its rotary pairs adjacent dims; HF rotates halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _float_weight(data: np.ndarray, tensor_type: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's values (or a slice of its rows) as float32 of `shape`."""
    from gguf.quants import dequantize

    if tensor_type.name in TORCH_DEQUANTIZERS:
        return TORCH_DEQUANTIZERS[tensor_type.name](data, shape)
    return torch.from_numpy(np.array(dequantize(data, tensor_type), dtype=np.float32).reshape(shape))


def _dequantised(
    tensors: list, cfg: dict[str, Any], arch: str, int4_blocks: bool = False, routed_experts: bool = True
) -> Iterator[tuple[str, torch.Tensor | Int4Blocks]]:
    for t in tensors:
        if t.name == "rope_freqs.weight":
            yield "rope_freqs", torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        name = hf_tensor_name(t.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no counterpart in the {arch} model")
        if "{e}" in name and not routed_experts:
            continue  # never read: the experts run elsewhere
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        if "{e}" in name and int4_blocks and t.tensor_type.name in INT4_TYPE_NAMES:
            # routed experts kept in the file's blocks, one weight per expert (`gguf_quant.int4_experts`)
            for e in range(shape[0]):
                yield name.format(e=e), to_int4_blocks(t.data[e], t.tensor_type.name, shape[1:])
            continue
        tensor: torch.Tensor | Int4Blocks
        # routed experts are not linear layers of their own: the model stacks (or quantises) them
        linear = int4_blocks and _LINEAR_RE.search(name) is not None and "{e}" not in name
        if linear and t.tensor_type.name in INT4_TYPE_NAMES:
            tensor = to_int4_blocks(t.data, t.tensor_type.name, shape)
        else:
            tensor = _float_weight(t.data, t.tensor_type, shape)
        # the Q/K permutation moves whole rows, so it applies to blocks (codes, scales, zeros) as to floats
        unpermute = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            unpermute = cfg["num_attention_heads"]
        elif arch == "llama" and ".self_attn.k_proj." in name:
            unpermute = cfg["num_key_value_heads"]
        if unpermute is not None:
            if isinstance(tensor, Int4Blocks):
                tensor = tensor.map_rows(lambda x, n=unpermute: _unpermute(x, n))
            else:
                tensor = _unpermute(tensor, unpermute)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        if linear and not isinstance(tensor, Int4Blocks):  # a type with no int4 form: quantised here
            tensor = quantised_blocks(name, tensor.contiguous())
        if "{e}" in name:  # [experts, out, in]: one weight per expert, each its own storage
            for e in range(tensor.shape[0]):
                yield name.format(e=e), tensor[e].clone()
            continue
        if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor[None, :]  # llama.cpp stores the gate's single row as a vector
        yield name, tensor if isinstance(tensor, Int4Blocks) else tensor.contiguous()


def _converts_to_int4(t: GGUFTensor, arch: str) -> bool:
    """Whether `int4_blocks=True` quantises this tensor (a linear weight of a type with no int4 form)."""
    name = hf_tensor_name(t.name, arch)
    return (
        name is not None
        and _LINEAR_RE.search(name) is not None
        and "{e}" not in name
        and t.tensor_type.name not in INT4_TYPE_NAMES
    )


@dataclass
class GGUFExperts:
    """The routed experts of a GGUF file, read one expert (and rows of it) at a time: what an
    expert server loads and an attention client fingerprints, without reading the rest."""

    hf_config: dict[str, Any]
    tensors: dict[tuple[int, str], GGUFTensor]  # (layer, gate | up | down) -> the 3-D tensor

    def weight(self, layer: int, expert: int, part: str, rows: slice = slice(None)) -> torch.Tensor:
        """Rows of one expert's [out, in] weight as float32."""
        t = self.tensors.get((layer, part))
        if t is None:
            raise ValueError(f"GGUF file lacks weights: layer {layer} has no ffn_{part}_exps")
        num_experts, out_f, in_f = (int(x) for x in reversed(t.shape))
        if not 0 <= expert < num_experts:
            raise ValueError(f"layer {layer}'s ffn_{part}_exps holds {num_experts} experts, not {expert + 1}")
        data = t.data[expert][rows]
        return _float_weight(data, t.tensor_type, (data.shape[0], in_f))

    def rows(self, layer: int, part: str) -> int:
        return int(self.tensors[(layer, part)].shape[1])


_EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def read_gguf_experts(path: Path) -> GGUFExperts:
    """The config and routed-expert tensors (views, nothing read yet) of a GGUF file."""
    header = GGUFHeader(Path(path), vocabulary=False)
    tensors = header.tensors()
    hf_config = gguf_to_hf_config(_config_meta(header), [t.name for t in tensors])
    experts = {}
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m and m[2] in _EXPERT_PARTS and m[3] == "weight":
            experts[(int(m[1]), _EXPERT_PARTS[m[2]])] = t
    return GGUFExperts(hf_config, experts)


# --- cache --------------------------------------------------------------------------------------


def _write_cache_entry(
    entry: Path,
    source: Path,
    sha: str,
    hf_config: dict,
    weights: dict[str, torch.Tensor] | None,
    freq_factors: tuple[float, ...] | None,
    int4: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write an entry atomically: float `weights` (weights.safetensors) or the native entry's `int4`
    tensors (int4.safetensors, its sha256 kept in model.json to catch a damaged file)."""
    from safetensors.torch import save, save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.")
    )  # one per writer, thread or process
    try:
        info = {
            "format": CACHE_FORMAT,
            "source": str(source),
            "sha256": sha,
            "hf_config": hf_config,
            "rope_freq_factors": freq_factors,
        }
        if weights is not None:
            save_file(weights, str(tmp / "weights.safetensors"))
        if int4 is not None:
            data = save(int4)
            (tmp / "int4.safetensors").write_bytes(data)
            info["int4_sha256"] = hashlib.sha256(data).hexdigest()
        # model.json last: its presence marks a complete entry
        (tmp / "model.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
        try:
            os.rename(tmp, entry)
        except OSError:  # another process finished the same entry first
            if not (entry / "model.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _caching_int4(
    weights: Iterator[tuple[str, torch.Tensor | Int4Blocks]],
    converted: set[str | None],
    entry: Path,
    source: Path,
    sha: str,
    hf_config: dict,
    freq_factors: tuple[float, ...] | None,
) -> Iterator[tuple[str, torch.Tensor | Int4Blocks]]:
    """`weights` passed through; once all were read, the blocks named in `converted` are written
    as the native entry (a load that fails half-way writes nothing)."""
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in converted and isinstance(tensor, Int4Blocks):
            codes = tensor.codes
            kept[f"{name}.codes"] = codes[:, 0::2] | (codes[:, 1::2] << 4)  # two codes a byte
            kept[f"{name}.scales"] = tensor.scales
            kept[f"{name}.zeros"] = tensor.zeros
        yield name, tensor
    try:
        _write_cache_entry(entry, source, sha, hf_config, None, freq_factors, int4=kept)
    except Exception as exc:  # noqa: BLE001 - the weights are loaded: a cache that cannot be written costs the next start only
        warnings.warn(f"could not write the gguf_native cache entry {entry}: {exc}", stacklevel=2)


def _read_int4_entry(entry: Path) -> tuple[dict, dict[str, Int4Blocks]] | None:
    """Config and cached blocks of a native entry; None when there is none. A damaged
    entry (unreadable, or int4.safetensors not matching its recorded sha256) is removed, to be rebuilt."""
    from safetensors.torch import load

    if not (entry / "model.json").is_file():
        return None
    try:
        info = json.loads((entry / "model.json").read_text(encoding="utf-8"))
        data = (entry / "int4.safetensors").read_bytes()
        if hashlib.sha256(data).hexdigest() != info["int4_sha256"]:
            raise ValueError("int4.safetensors does not match its sha256")
        tensors = load(data)
    except (OSError, ValueError, KeyError) as e:
        warnings.warn(f"GGUF native cache entry {entry} is damaged ({e}); rebuilding it", stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    blocks = {}
    for key in tensors:
        if key.endswith(".codes"):
            name = key.removesuffix(".codes")
            packed = tensors[key]
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
            blocks[name] = Int4Blocks(codes, tensors[f"{name}.scales"], tensors[f"{name}.zeros"])
    return info["hf_config"], blocks


def _with_cached_blocks(
    tensors: list[GGUFTensor],
    cfg: dict[str, Any],
    arch: str,
    blocks: dict[str, Int4Blocks],
    routed_experts: bool = True,
) -> Iterator[tuple[str, torch.Tensor | Int4Blocks]]:
    """The `int4_blocks=True` weights with the cached blocks in place of their conversion."""
    for t in tensors:
        name = hf_tensor_name(t.name, arch)
        if name in blocks:
            yield name, blocks[name]
        else:
            yield from _dequantised([t], cfg, arch, int4_blocks=True, routed_experts=routed_experts)


# a routed expert's weight as the float cache names it (one entry per expert)
_CACHED_EXPERT = re.compile(r"\.experts\.\d+\.")


def _read_cache_entry(
    path: Path, sha: str, cache_dir: Path, entry: Path, routed_experts: bool = True
) -> GGUFModel:
    from safetensors import safe_open

    info = json.loads((entry / "model.json").read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    tokenizer = gguf_tokenizer(path, cache_dir, legacy=_legacy_tokenizers(entry))
    tokenizer_s = time.perf_counter() - t0

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(entry / "weights.safetensors"), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if routed_experts or not _CACHED_EXPERT.search(key):
                    yield key, f.get_tensor(key)

    factors = info.get("rope_freq_factors")
    return GGUFModel(
        path=path,
        sha256=sha,
        hf_config=info["hf_config"],
        tokenizer=tokenizer,
        weights=weights(),
        rope_freq_factors=tuple(factors) if factors else None,
        from_cache=True,
        tokenizer_s=tokenizer_s,
    )
