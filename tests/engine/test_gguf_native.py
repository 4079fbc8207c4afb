"""GGUF 4-bit blocks used directly as int4 linear layers (`gguf_native`).

Tiny GGUF files are written the way llama.cpp's converter does (Llama Q/K rows permuted), with the
linear weights quantised by `gguf.quants` to Q4_0 / Q4_1; Q4_K blocks (which gguf-py cannot
quantise) are random bytes with valid scales. Checked: the blocks convert to codes, scales and zeros
that dequantise bit-equal to `gguf.quants.dequantize`; a model loaded natively gives the same logits
as the dequantised float model re-quantised exactly (each 32-group's own min and step, float32;
parts of other types with the load-time quantiser) and run through the same int4 kernel; and,
marked `bundled`, the SmolLM2 (Q4_1) and Gemma 3 (Q4_K_M) files agree with their float32 path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenops.engine.gguf_quant import TORCH_DEQUANTIZERS, Int4Blocks, int4_blocks
from tokenops.engine.gguf_reader import _BLOCK_MAPS, _TOP_LEVEL, read_gguf
from tokenops.engine.loader import load_model
from tokenops.engine.quantize import Int4WeightOnlyLinear, quantize_int4
from tokenops.engine.quantize.common import block_kernels
from tokenops.modelfiles.files import GGUFHeader, file_sha256, tokenizer_entry
from tokenops.modelfiles.files import parse_gguf as _parse

from .conftest import prompt_logits

IDS = [5, 77, 3, 190, 42, 42, 7, 255, 128, 9, 10, 11, 12, 13, 64, 32, 1, 99, 100, 101, 17, 18]
LINEARS = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")


def _gguf_name(hf_name: str, arch: str) -> str:
    inverse_top = {v: k for k, v in _TOP_LEVEL.items()}
    base, _, kind = hf_name.rpartition(".")
    if base in inverse_top:
        return f"{inverse_top[base]}.{kind}"
    parts = base.split(".")  # model.layers.N.sub...
    inverse = {v: k for k, v in _BLOCK_MAPS[arch].items()}
    return f"blk.{parts[2]}.{inverse['.'.join(parts[3:])]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_quantised_llama(path: Path, tiny, qtypes: dict[str, str]) -> None:
    """The tiny Llama as a GGUF file whose linear weights are quantised per `qtypes` (part -> type)."""
    import gguf
    from gguf.quants import quantize

    from tokenops.modelfiles.tokenizer import _bytes_to_unicode

    cfg = tiny.hf_config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([_bytes_to_unicode()[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in tiny.hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = tensor.detach().float().numpy().copy()
        if ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        part = next((p for p in LINEARS if p in name), None)
        qtype = getattr(gguf.GGMLQuantizationType, qtypes.get(part, "F32"))
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name, "llama"), w)
        else:
            writer.add_tensor(_gguf_name(name, "llama"), quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _exact_int4(weight: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference re-quantisation of an already 4-bit weight, per 32-group in float32 (rounded to bf16
    only by the module, like the native path). Q4_1 puts the group's min at code 0 and max at 15:
    step = (max - min) / 15, zero = min + 8 * step. Q4_0 puts the value of largest magnitude at
    code 0: step = -that / 8, zero 0."""
    out_f, in_f = weight.shape
    g = weight.view(out_f, -1, 32)
    if qtype == "Q4_0":
        extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0]
        step = -extreme / 8
        zero = torch.zeros_like(step)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        step = (hi - lo) / 15
        zero = lo + 8 * step
    codes = torch.round((g - zero[..., None]) / step[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return codes.view(out_f, in_f), step, zero


_SHARDS = {"qkv_proj": (".q_proj.", ".k_proj.", ".v_proj."), "gate_up_proj": (".gate_proj.", ".up_proj.")}


def _requantise(model, qtypes: dict[str, str]) -> None:
    """Every linear of the dequantised float model as int4: 4-bit parts re-quantised exactly, the
    others with the load-time quantiser (group 32), fused parts concatenated."""
    for name, m in list(model.named_modules()):
        if not isinstance(m, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        leaf = name.rpartition(".")[2]
        hf_parts = _SHARDS.get(leaf, (f".{leaf}.",))
        sizes = getattr(m, "shard_sizes", [m.out_features])
        pieces = []
        for part, rows in zip(hf_parts, m.weight.detach().split(sizes), strict=True):
            qtype = qtypes.get(part, "F32")
            pieces.append(_exact_int4(rows, qtype) if qtype.startswith("Q4") else quantize_int4(rows, 32))
        codes, scales, zeros = (torch.cat(x) for x in zip(*pieces, strict=True))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int4WeightOnlyLinear(codes, scales, zeros, m.in_features))


# --- block conversion ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_blocks_dequantise_bit_equal_to_gguf(qtype) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * 0.05 + rng.uniform(-0.02, 0.02, (48, 1))).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = quantize(w, t)
    blocks = int4_blocks(raw, qtype, (48, 96))
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    assert blocks.scales.shape == (48, 3) and blocks.zeros.shape == (48, 3)
    ref = torch.from_numpy(dequantize(raw, t).reshape(48, 96))
    assert torch.equal(blocks.dequantize(), ref)


def test_q4_k_blocks_dequantise_bit_equal_to_gguf() -> None:
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    out_f, in_f = 32, 512  # two 256-weight super-blocks per row
    raw = rng.integers(0, 256, (out_f, in_f // 256, 144), dtype=np.uint8)
    raw[..., 0:2] = np.float16(rng.uniform(1e-4, 1e-2, (out_f, in_f // 256, 1))).view(np.uint8)  # d
    raw[..., 2:4] = np.float16(rng.uniform(1e-4, 1e-2, (out_f, in_f // 256, 1))).view(np.uint8)  # dmin
    raw = raw.reshape(out_f, -1)
    blocks = int4_blocks(raw, "Q4_K", (out_f, in_f))
    ref = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(out_f, in_f))
    # (q - 8) * scale + zero vs scale * q - min: the same up to float32 rounding where they cancel
    torch.testing.assert_close(blocks.dequantize(), ref, rtol=1e-6, atol=2**-22 * float(ref.abs().max()))
    # every one of the 8 sub-blocks has its own scale: the codes sit where gguf-py reads them
    assert blocks.scales.shape == (out_f, in_f // 32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_torch_dequantisers_are_bit_equal_to_gguf(qtype) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = quantize(w, t)
    ref = dequantize(raw, t).reshape(40, 64)
    assert torch.equal(TORCH_DEQUANTIZERS[qtype](raw, (40, 64)), torch.from_numpy(ref))


def test_other_types_are_refused() -> None:
    with pytest.raises(ValueError, match="no int4 form"):
        int4_blocks(np.zeros(34, dtype=np.uint8), "Q8_0", (1, 32))
    with pytest.raises(ValueError, match="should hold"):
        int4_blocks(np.zeros(19, dtype=np.uint8), "Q4_1", (1, 32))


# --- tiny models --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "qtypes",
    [
        {p: "Q4_1" for p in LINEARS},
        # mixed like llama.cpp's Q4_K_M: a fused q|k|v and gate|up with parts of different types
        {
            ".q_proj.": "Q4_0",
            ".k_proj.": "Q4_1",
            ".v_proj.": "Q8_0",
            ".o_proj.": "Q4_0",
            ".gate_proj.": "Q4_1",
            ".up_proj.": "F32",
            ".down_proj.": "Q4_1",
        },
    ],
    ids=["q4_1", "mixed"],
)
def test_native_model_matches_dequantised_model_through_int4_kernel(tiny_llama, tmp_path, qtypes) -> None:
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, qtypes)
    cache = tmp_path / "cache"

    native = load_model(str(path), cache_dir=cache, gguf_native=True)
    assert native.load_stats["gguf_native"] is True
    int4 = [m for m in native.model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    assert len(int4) == 4 * tiny_llama.config.num_layers  # qkv, o, gate_up, down
    assert not any(isinstance(m, torch.nn.Linear) for m in native.model.model.layers.modules())
    # no float cache: the native entry keeps config and the blocks quantised at load, the tokenizer
    # its own entry
    assert native.load_stats["from_cache"] is False
    assert [e.name for e in (cache / "gguf").iterdir()] == [f"{file_sha256(path)}-v1-int4"]
    files = {f.name for f in (cache / "gguf" / f"{file_sha256(path)}-v1-int4").iterdir()}
    assert files == {"model.json", "int4.safetensors"}
    assert [e.name for e in (cache / "gguf-tokenizer").iterdir()] == [
        tokenizer_entry(cache, GGUFHeader(path).sha256()).name
    ]
    again = load_model(str(path), cache_dir=cache, gguf_native=True)
    assert again.load_stats["from_cache"] is True
    torch.testing.assert_close(
        prompt_logits(again.model, IDS), prompt_logits(native.model, IDS), rtol=0, atol=0
    )

    floats = load_model(str(path), cache_dir=cache)
    float_logits = prompt_logits(floats.model, IDS)
    _requantise(floats.model, qtypes)
    native_logits = prompt_logits(native.model, IDS)
    torch.testing.assert_close(native_logits, prompt_logits(floats.model, IDS), rtol=0, atol=1e-5)
    # and int4 is close to the float model it came from (bf16 activations in the kernel)
    assert (native_logits - float_logits).abs().max() < 0.05 * (float_logits.max() - float_logits.min())
    assert native.tokenizer.encode("héllo") == floats.tokenizer.encode("héllo")


def test_native_rows_follow_the_llama_qk_unpermutation(tiny_llama, tmp_path) -> None:
    """q|k|v rows of the native layer dequantise to the float path's (un-permuted) rows."""
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, {p: "Q4_0" for p in LINEARS})
    native = load_model(str(path), cache_dir=tmp_path / "c", gguf_native=True)
    floats = load_model(str(path), cache_dir=tmp_path / "c")
    qkv = native.model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad():  # the weight as the kernel sees it: identity activations (exact in bf16)
        w = qkv(torch.eye(qkv.in_features)).t()
    ref = floats.model.model.layers[0].self_attn.qkv_proj.weight.detach()
    # bf16 scale and bf16 arithmetic in the kernel: within a few bf16 steps of the group's largest weight
    group_max = ref.abs().view(ref.shape[0], -1, 32).amax(-1, keepdim=True)
    assert ((w - ref).abs().view(ref.shape[0], -1, 32) <= group_max * 2**-7).all()
    # and the rows really are un-permuted: against the permuted order the error is far larger
    assert (w - ref).abs().max() < 0.1 * ref.abs().max()


def test_engine_refuses_gguf_native_config_on_a_model_loaded_without_it(tiny_llama, tmp_path) -> None:
    """The int4 layers come from load_model; a config asking for them must not silently get load-time int4."""
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine

    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, {p: "Q4_1" for p in LINEARS})
    config = EngineConfig(quantization="int4", gguf_native=True)
    with pytest.raises(ValueError, match="loaded without it"):
        LLMEngine.from_loaded(load_model(str(path), cache_dir=tmp_path / "c"), config)
    engine = LLMEngine.from_loaded(load_model(str(path), cache_dir=tmp_path / "c", gguf_native=True), config)
    assert engine.config.gguf_native


def test_native_needs_a_gguf_model(tiny_llama, tmp_path) -> None:
    folder = tmp_path / "hf"
    tiny_llama.hf.save_pretrained(folder)
    with pytest.raises(ValueError, match="gguf_native needs a GGUF model"):
        load_model(str(folder), gguf_native=True)


def test_engine_config_validates_gguf_native() -> None:
    from tokenops.engine.config import EngineConfig

    assert EngineConfig(quantization="int4", gguf_native=True).gguf_native
    with pytest.raises(ValueError, match="gguf_native"):
        EngineConfig(gguf_native=True)
    with pytest.raises(ValueError, match="gguf_native"):
        EngineConfig(quantization="int4", quantization_group_size=64, gguf_native=True)


# --- native cache -------------------------------------------------------------------------------

MIXED = {
    ".q_proj.": "Q4_0",
    ".k_proj.": "Q4_1",
    ".v_proj.": "Q8_0",
    ".o_proj.": "Q4_0",
    ".gate_proj.": "Q4_1",
    ".up_proj.": "F32",
    ".down_proj.": "Q5_0",
}


def _native_weights(path: Path, cache: Path) -> tuple[dict, bool]:
    g = read_gguf(path, cache, int4_blocks=True)
    return dict(g.weights), g.from_cache


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert type(x) is type(y), name
        pairs = (
            [(x.codes, y.codes), (x.scales, y.scales), (x.zeros, y.zeros)]
            if isinstance(x, Int4Blocks)
            else [(x, y)]
        )
        for u, v in pairs:
            assert u.dtype == v.dtype and torch.equal(u, v), name


def _int4_entry(path: Path, cache: Path) -> Path:
    return cache / "gguf" / f"{file_sha256(path)}-v1-int4"


def test_warm_native_load_reads_the_cache_and_equals_the_cold_one(tiny_llama, tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, MIXED)
    cache = tmp_path / "cache"
    cold, cold_hit = _native_weights(path, cache)
    warm, warm_hit = _native_weights(path, cache)
    assert (cold_hit, warm_hit) == (False, True)
    _assert_same_weights(cold, warm)
    # only what was quantised at load is kept (4-bit parts are read from the file), codes two a byte
    from safetensors import safe_open

    with safe_open(str(_int4_entry(path, cache) / "int4.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        packed = f.get_tensor("model.layers.0.self_attn.v_proj.weight.codes")
    converted = {n for n in cold if any(p in n for p in (".v_proj.", ".up_proj.", ".down_proj."))}
    assert keys == {f"{n}.{part}" for n in converted for part in ("codes", "scales", "zeros")}
    assert (
        packed.dtype == torch.uint8
        and packed.shape[1] * 2 == cold["model.layers.0.self_attn.v_proj.weight"].shape[1]
    )

    a = load_model(str(path), cache_dir=tmp_path / "fresh", gguf_native=True)
    b = load_model(str(path), cache_dir=tmp_path / "fresh", gguf_native=True)
    assert (a.load_stats["from_cache"], b.load_stats["from_cache"]) == (False, True)
    torch.testing.assert_close(prompt_logits(b.model, IDS), prompt_logits(a.model, IDS), rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_damaged_native_entry_is_rebuilt(tiny_llama, tmp_path, damage) -> None:
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, MIXED)
    cache = tmp_path / "cache"
    cold, _ = _native_weights(path, cache)
    file = _int4_entry(path, cache) / "int4.safetensors"
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":  # one bit of a tensor, the header still valid
        file.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        file.unlink()
    with pytest.warns(UserWarning, match="damaged"):
        rebuilt, hit = _native_weights(path, cache)
    assert hit is False
    _assert_same_weights(cold, rebuilt)
    again, hit = _native_weights(path, cache)
    assert hit is True
    _assert_same_weights(cold, again)


def test_native_cache_is_per_file(tiny_llama, tmp_path) -> None:
    cache = tmp_path / "cache"
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_quantised_llama(first, tiny_llama, MIXED)
    write_quantised_llama(second, tiny_llama, {**MIXED, ".q_proj.": "Q8_0"})
    a, _ = _native_weights(first, cache)
    b, hit = _native_weights(second, cache)
    assert hit is False
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"].codes, b["model.layers.0.self_attn.q_proj.weight"].codes
    )
    assert sorted(e.name for e in (cache / "gguf").iterdir()) == sorted(
        f"{file_sha256(p)}-v1-int4" for p in (first, second)
    )
    _assert_same_weights(b, _native_weights(second, cache)[0])


def test_parse_without_vocabulary_skips_only_the_string_arrays(tiny_llama, tmp_path) -> None:
    """What a warm native load parses: the same tensors and metadata, the token list left undecoded."""
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, MIXED)
    (meta, tensors), (lean, lean_tensors) = _parse(path), _parse(path, vocabulary=False)
    assert lean["tokenizer.ggml.tokens"] is None
    assert {k: v for k, v in lean.items() if v is not None} == {
        k: v for k, v in meta.items() if not _strings(v)
    }
    for a, b in zip(tensors, lean_tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, b.shape)
        assert np.array_equal(a.data, b.data)


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def test_half_read_native_load_writes_no_entry(tiny_llama, tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_quantised_llama(path, tiny_llama, MIXED)
    g = read_gguf(path, tmp_path / "cache", int4_blocks=True)
    next(g.weights)
    del g
    assert not _int4_entry(path, tmp_path / "cache").exists()


# --- bundled models -----------------------------------------------------------------------------


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(prompt_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


@pytest.mark.bundled
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_bundled_native_agrees_with_float32(bundled_model, name) -> None:
    """Native int4 is at least as close to the float32 path as load-time int4 of the dequantised
    weights (SmolLM2: every linear is Q4_1, taken exactly; Gemma: only the Q4_K attn_output / half of
    ffn_down, the Q5_0 / Q6_K / Q8_0 rest is quantised at load either way), and picks float32's greedy
    tokens."""
    from tokenops.engine.quantize import quantize_model
    from tokenops.modelfiles.bundled import resolve_bundled
    from tokenops.modelfiles.files import default_cache_dir

    floats = bundled_model(name)
    native = load_model(name, gguf_native=True)
    loadtime = load_model(name)
    quantize_model(loadtime.model, "int4", group_size=32)
    _, tensors = _parse(resolve_bundled(name, default_cache_dir()))
    assert any(t.tensor_type.name in ("Q4_1", "Q4_K") for t in tensors)
    prompt = floats.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    a, b, c = (
        prompt_logits(floats.model, prompt),
        prompt_logits(native.model, prompt),
        prompt_logits(loadtime.model, prompt),
    )
    native_err, loadtime_err = (a - b).pow(2).mean().sqrt(), (a - c).pow(2).mean().sqrt()
    assert int(a[-1].argmax()) == int(b[-1].argmax())
    # where int4 runs the block kernels (AVX2: W4A8), both paths round every activation to int8 per
    # block, and that noise, not the weights' (exact against re-quantised), sets both errors
    margin = 1.25 if block_kernels("cpu") else 1.0
    assert native_err <= margin * loadtime_err
    # along float32's greedy continuation, teacher-forced (one flipped near-tie would otherwise decide
    # every later token): the same next token at most positions, and a different one only where
    # float32's own top two are within half a logit
    ids, agree = list(prompt), 0
    for token in _greedy(floats.model, prompt, 16):
        ref, got = prompt_logits(floats.model, ids)[-1], prompt_logits(native.model, ids)[-1]
        top2 = ref.topk(2).values
        if int(got.argmax()) == token:
            agree += 1
        else:
            assert float(top2[0] - top2[1]) < 0.5, (len(ids) - len(prompt), top2.tolist())
        ids.append(token)
    print(
        f"{name}: rms logit error vs float32 native {float(native_err):.3f}, load-time int4 "
        f"{float(loadtime_err):.3f}; teacher-forced greedy agreement {agree}/16"
    )
    assert agree >= 12
