"""Fixtures shared across test packages: a tiny random-weight "thinking" Llama, and the bundled models.

None of the bundled models think, so `thinker` builds one: a two-layer random Llama saved as a
Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) whose
byte-level tokenizer has `<think>` (256) and `</think>` (257) as added tokens (not special, as in
Qwen3) and whose chat template opens a thinking section ("r1", as DeepSeek-R1's does) or lets the
model open one and honours `enable_thinking=false` ("qwen3"). It is loaded with the real loader, so
marker detection runs on the real tokenizer. A logits bias keeps the random model from ever emitting
`</think>`, `<think>` or end-of-turn on its own, so only a budget (or max_tokens) ends its thinking.
A third style, "reason", opens `<reason>`, a marker of eight byte tokens, for split-marker tests.
`bundled_model` / `bundled_pair` load a bundled model once per session (with transformers' conversion
of the same file beside it); their tests are marked `bundled`. `tiny_llama` / `tiny_gemma3` build a
small random HF config, an HF reference model (transformers, test-only) and our model loaded from the
reference's state dict, so any test can compare our logits or greedy tokens with HF's, or serve them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from tokenops.engine.models import CausalLM, ModelConfig

THINK, END_THINK, EOS = 256, 257, 2
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
)
TEMPLATES = {
    "r1": _CHATML + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    # thinking in multi-token markers (configured, not detected): "<reason>" is 8 byte tokens
    "reason": _CHATML + "{% if add_generation_prompt %}<|im_start|>assistant\n<reason>\n{% endif %}",
    "qwen3": _CHATML
    + (
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    ),
}


def _byte_vocab() -> dict[str, int]:
    from tokenops.modelfiles.tokenizer import _bytes_to_unicode

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in _bytes_to_unicode().items():
        if b >= 3:  # bytes 0x00-0x02 make room for the specials
            vocab[ch] = b
    return vocab


def _write_tokenizer(folder: Path, template: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tok.add_tokens(
        [
            AddedToken("<think>", normalized=False, special=False),
            AddedToken("</think>", normalized=False, special=False),
        ]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": template})
    )


def _write_model(folder: Path) -> None:
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(str(folder), safe_serialization=True)


def suppress_marker_tokens(model: torch.nn.Module) -> None:
    """The random model never emits <think>, </think> or end-of-turn by itself, and writes ASCII
    only, so texts decoded in pieces and as a whole compare exactly (test-only bias)."""
    compute = model.compute_logits
    banned = [0, 1, EOS, *range(128, 256), THINK, END_THINK]

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        logits[:, banned] = float("-inf")
        return logits

    model.compute_logits = biased


@pytest.fixture(scope="session")
def thinker_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"r1": folder, "qwen3": folder}: the same weights under the two chat templates."""
    root = tmp_path_factory.mktemp("thinker")
    weights = root / "weights"
    weights.mkdir()
    _write_model(weights)
    out = {}
    for style, template in TEMPLATES.items():
        folder = root / f"thinker-{style}"
        shutil.copytree(weights, folder)
        _write_tokenizer(folder, template)
        out[style] = folder
    return out


@pytest.fixture(scope="session")
def thinker(thinker_folders: dict[str, Path]):
    """`thinker(style)` -> a freshly loaded `LoadedModel` with the marker-suppressing bias."""
    from tokenops.engine.loader import load_model

    def load(style: str = "r1"):
        loaded = load_model(str(thinker_folders[style]))
        suppress_marker_tokens(loaded.model)
        return loaded

    return load


# --- tiny random dense models with a Hugging Face reference (the engine's tests, the cluster's PD tests) --


@dataclass
class TinyModel:
    """A random-weight model pair: `hf` (transformers) and `model` (ours), same weights, float32."""

    hf: torch.nn.Module
    model: CausalLM
    config: ModelConfig
    hf_config: object


def _ours_from_hf(hf: torch.nn.Module) -> tuple[CausalLM, ModelConfig]:
    import torch

    from tokenops.engine.models import ModelConfig, build_model

    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(config, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    return model, config


@pytest.fixture(scope="session")
def tiny_llama() -> TinyModel:
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(hf_config).float().eval()
    # HF init leaves RMSNorm weights at 1; randomise them so a wrong norm path cannot hide
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model, config = _ours_from_hf(hf)
    return TinyModel(hf=hf, model=model, config=config, hf_config=hf_config)


@pytest.fixture(scope="session")
def tiny_gemma3() -> TinyModel:
    """Two layers (sliding, then global) with a 5-token window, so 20-token prompts exercise it."""
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf_config = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=24,  # differs from head_dim so a wrong scale shows
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation="eager",
    )
    hf = transformers.Gemma3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # Gemma norms are offsets from 1: HF inits them to 0
                p.uniform_(-0.5, 0.5)
    model, config = _ours_from_hf(hf)
    return TinyModel(hf=hf, model=model, config=config, hf_config=hf_config)


# --- bundled models (session-scoped; tests using them are marked `bundled`) ------------------------


@pytest.fixture(scope="session")
def bundled_model():
    """`bundled_model(name)` -> LoadedModel, loaded once per session (float32, default cache dir)."""
    from tokenops.engine.loader import load_model

    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        return loaded[name]

    return get


def build_hf_reference(gguf_path, ref_dir) -> None:
    """transformers' conversion of a GGUF file (model + tokenizer), saved as a plain HF folder.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the float32 state dict and the
    config (without its gguf quantization_config) are written directly.
    """
    import json
    import os
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_model

    tmp = ref_dir.with_name(ref_dir.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kw = dict(gguf_file=gguf_path.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    tok.save_pretrained(tmp)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    save_model(hf, str(tmp / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(hf).__name__]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    (tmp / "done").write_text("ok")
    shutil.rmtree(ref_dir, ignore_errors=True)
    os.replace(tmp, ref_dir)


@pytest.fixture(scope="session")
def bundled_pair(bundled_model):
    """`bundled_pair(name)` -> (ours, HF model, HF tokenizer), HF's side being transformers' own
    conversion of the same GGUF file.

    transformers' GGUF reader takes minutes on the 262k-token Gemma vocabulary, so its converted
    model and tokenizer are saved once (`build_hf_reference`) under
    `<cache>/test-reference/<gguf sha256>-transformers-<version>/` and reloaded from there; delete
    that folder to redo the conversion.
    """
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    import torch

    from tokenops.modelfiles.files import default_cache_dir

    pairs: dict[str, tuple] = {}

    def get(name: str):
        if name in pairs:
            return pairs[name]
        ours = bundled_model(name)
        ref_dir = (
            default_cache_dir()
            / "test-reference"
            / f"{ours.load_stats['sha256']}-transformers-{transformers.__version__}"
        )
        if not (ref_dir / "done").is_file():
            build_hf_reference(ours.path, ref_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(ref_dir))
        pairs[name] = (ours, hf, tok)
        return pairs[name]

    return get
