"""Text <-> token ids and chat templates for a loaded model.

`Tokenizer` wraps a `tokenizers.Tokenizer` (Rust, fast) with what the engine needs on top: the
special ids (BOS, end-of-sequence / end-of-turn), whether encoding adds BOS, and the model's chat
template rendered with jinja2 the way Hugging Face renders it. It is built either from a HF folder
(tokenizer.json + tokenizer_config.json) or from a GGUF file's `tokenizer.ggml.*` metadata, for
which this module rebuilds the tokenizer by hand (byte-level BPE for "gpt2" vocabularies,
SentencePiece-style BPE with byte fallback for "llama" vocabularies). transformers is never
imported here: it is a test-only dependency.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

# token types of llama.cpp's vocabulary (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# end-of-turn markers that llama.cpp also treats as end of generation when the vocabulary has them
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre`; applied before byte-level BPE
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    # SmolLM2, StarCoder: every digit alone, then GPT-2's regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM)
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}


class ChatTemplateError(ValueError):
    """A chat template rejected the conversation (its `raise_exception`) or failed to render."""


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # bos_token, eos_token, ... as strings, passed to the chat template like HF does
        self.special_tokens = dict(special_tokens or {})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text for `messages`, as the model's template (jinja2) writes it; `variables`
        are extra template variables (e.g. Qwen3's `enable_thinking`)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        from jinja2 import TemplateError

        try:
            template = _compile_template(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **{**self.special_tokens, **variables},
            )
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """tokenizer.json, plus tokenizer_config.json / chat_template.jinja / generation_config.json."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json (a slow-only tokenizer is not supported)"
            )
        backend = RustTokenizer.from_file(str(path))
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tok_cfg.get(key)
            if isinstance(value, dict):  # serialised AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value

        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif not template and (folder / "chat_template.json").is_file():
            template = _read_json(folder / "chat_template.json").get("chat_template")

        eos_ids: list[int] = []
        for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(source, int):
                eos_ids.append(source)
            elif isinstance(source, list):
                eos_ids.extend(int(x) for x in source)
        if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos_id is None:
            bos_id = model_cfg.get("bos_token_id")
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            special_tokens=special,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes from its `tokenizer.ggml.*` /
        `tokenizer.chat_template` keys."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(
                tokens, types, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre")
            )
            default_add_bos = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, types, meta)
            default_add_bos = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        single, pairs = "$A", []
        if add_bos and bos_id is not None:
            single = f"{tokens[bos_id]} {single}"
            pairs.append((tokens[bos_id], bos_id))
        if add_eos and eos_id is not None:
            single = f"{single} {tokens[eos_id]}"
            pairs.append((tokens[eos_id], eos_id))
        if pairs:
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=pairs)

        eos_ids = [eos_id] if eos_id is not None else []
        eos_ids += [
            i
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
            if ty == _CONTROL and t in _END_OF_TURN
        ]
        special = {}
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            idx = meta.get(f"tokenizer.ggml.{key}_token_id")
            if idx is not None and 0 <= idx < len(tokens):
                special[name] = tokens[idx]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
        )

    # --- persistence (the GGUF tokenizer cache, `files.gguf_tokenizer`) ---

    def write_files(self, path: Path) -> dict[str, Any]:
        """Write the backend as `path` (the `tokenizers` library's tokenizer.json); return what it
        does not hold (special ids, chat template, special token strings) for `from_files`."""
        self.backend.save(str(path), pretty=False)
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
        }

    @classmethod
    def from_files(cls, path: Path, info: dict[str, Any]) -> Tokenizer:
        """The tokenizer `write_files` wrote: `Tokenizer.from_file(path)` plus its `info`."""
        return cls(
            RustTokenizer.from_file(str(path)),
            bos_token_id=info["bos_token_id"],
            eos_token_ids=info["eos_token_ids"],
            chat_template=info["chat_template"],
            special_tokens=info["special_tokens"],
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tokenizer:
        """The tokenizer.json that GGUF weight cache entries held before the tokenizer had its own
        cache: the backend's JSON as a string, beside the special ids and the chat template."""
        return cls(
            RustTokenizer.from_str(data["tokenizer_json"]),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=data.get("eos_token_ids") or [],
            chat_template=data.get("chat_template"),
            special_tokens=data.get("special_tokens") or {},
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _add_vocab_specials(
    backend: RustTokenizer, tokens: list[str], types: list[int], allowed: set[str] | None
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both stay
    whole."""
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _CONTROL and (allowed is None or set(t) <= allowed)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED
    ]
    if user:
        backend.add_tokens(user)


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> RustTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    splits = _BYTE_LEVEL_SPLITS.get(pre or "default")
    if splits is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_BYTE_LEVEL_SPLITS))})"
        )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_vocab_specials(backend, tokens, types, alphabet)
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], meta: dict[str, Any]) -> RustTokenizer:
    """SentencePiece BPE with byte fallback (Llama 2, Gemma).

    Spaces become U+2581; the merges come from the vocabulary.
    """
    arch = meta.get("general.architecture", "")
    if arch.startswith("gemma"):
        # Gemma files spell multi-space tokens with real spaces; the normalised text has U+2581 runs
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's scores do not follow its merge order; the order of the vocabulary does
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = RustTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_ranks(vocab, rank),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    norm: list[normalizers.Normalizer] = []
    if meta.get("tokenizer.ggml.add_space_prefix", not arch.startswith("gemma")):
        norm.append(normalizers.Prepend("\u2581"))
    norm.append(normalizers.Replace(" ", "\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(content=" ", left=1, right=0)] if len(norm) == 2 else [])
    )
    _add_vocab_specials(backend, tokens, types, None)
    return backend


def _merges_from_ranks(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces.

    Best piece first (highest rank), then the longer left part; the same order as HF's
    `generate_merges`, so ids match transformers' GGUF tokenizer.
    """
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, score in rank.items():
        local = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()  # by the parts' ids, as HF does before its stable sort
        merges.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    # stable sort, descending on (score, len(left), len(right)); ties keep the order above
    merges.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in merges]


# --- chat templates -----------------------------------------------------------------------------


def template_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """OpenAI wire messages (`protocol.ChatMessage`) as the dicts a chat template reads: every field
    the client sent, with list-of-parts content joined to its text. The engine server renders with
    this, and so does the gateway's prompt tokeniser (tokenops.cluster), so both see the same prompt."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d["content"] = m.text()
        out.append(d)
    return out


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: no HTML escaping (jinja's default tojson escapes <, >, &, ')
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str):
    """A sandboxed jinja2 template configured like transformers' chat-template renderer."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
