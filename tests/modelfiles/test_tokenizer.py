"""Tokenizer: building from GGUF metadata, encode/decode, specials, chat templates rendered like HF.

Fast tests use small hand-written vocabularies (and, where transformers can build the same thing,
compare with it); the bundled tests (marked `bundled`) compare our ids with transformers' GGUF
tokenizer on the real vocabularies.
"""

from __future__ import annotations

import json

import pytest

from tokenops.modelfiles.tokenizer import ChatTemplateError, Tokenizer, _bytes_to_unicode


def _byte_level_meta(merges: list[str] | None = None, template: str | None = None) -> dict:
    alphabet = [_bytes_to_unicode()[b] for b in range(256)]
    merged = ["Ġt", "he", "Ġthe", "ll", "llo"]
    tokens = alphabet + merged + ["<|im_start|>", "<|im_end|>", "<think>"]
    types = [1] * (256 + len(merged)) + [3, 3, 4]
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges if merges is not None else ["Ġ t", "h e", "Ġt he", "l l", "ll o"],
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
    }
    if template:
        meta["tokenizer.chat_template"] = template
    return meta


def _spm_meta() -> dict:
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "he",
        "ll",
        "lo",
        "▁he",
        "llo",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    tokens = pieces + words + ["<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(words) + [3, 3]
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


def test_byte_level_roundtrip_and_specials() -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta())
    text = "<|im_start|>hello the wörld 🙂  42\n<think><|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_ids[0]  # specials stay whole
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "hello the wörld 🙂  42\n<think>"  # user-defined tokens are not special
    assert tok.token_to_id("llo") in ids and tok.token_to_id("Ġthe") in ids
    assert tok.encode("hello", add_special_tokens=True) == tok.encode(
        "hello", add_special_tokens=False
    )  # no BOS for gpt2


def test_byte_level_digits_are_split_one_by_one_for_smollm() -> None:
    meta = _byte_level_meta(merges=["Ġ t", "h e", "Ġt he", "l l", "ll o", "4 2"])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["42"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1]
    assert Tokenizer.from_gguf_metadata(meta).encode("42") == [ord("4"), ord("2")]
    meta["tokenizer.ggml.pre"] = "gpt2"
    assert Tokenizer.from_gguf_metadata(meta).encode("42") == [len(meta["tokenizer.ggml.tokens"]) - 1]


def test_byte_level_matches_transformers_gpt2_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    meta = _byte_level_meta()
    ours = Tokenizer.from_gguf_metadata(meta)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"][:-3])}
    hf = transformers.GPT2Tokenizer(
        vocab=vocab, merges=[tuple(m.split()) for m in meta["tokenizer.ggml.merges"]]
    )
    for text in ["hello the world", "  spaced   out ", "héllo 日本 🙂", "tab\tnew\nline"]:
        assert ours.encode(text) == hf(text)["input_ids"], text


def test_sentencepiece_bpe_with_byte_fallback() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm_meta())
    ids = tok.encode("hello world")
    assert ids == [2, tok.token_to_id("he"), tok.token_to_id("llo"), tok.token_to_id("▁world")]
    # "é" is not a piece: it falls back to its two UTF-8 bytes, and decodes back
    ids = tok.encode("hé", add_special_tokens=False)
    assert ids == [tok.token_to_id("h"), tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    assert tok.decode(ids) == "hé"
    assert tok.decode(tok.encode("hello  world")) == "hello  world"
    assert set(tok.eos_token_ids) == {1, tok.token_to_id("<end_of_turn>")}


def test_sentencepiece_matches_transformers_gguf_builder() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = _spm_meta()
    ours = Tokenizer.from_gguf_metadata(meta)
    hf_dict = {
        "tokenizer_type": "llama",
        "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": meta["tokenizer.ggml.token_type"],
        "scores": meta["tokenizer.ggml.scores"],
    }
    hf, _ = convert_gguf_tokenizer("gemma3", hf_dict)
    for text in ["hello world", "world hello  hello", "héllo wörld", "<start_of_turn>hello<end_of_turn>"]:
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False).ids, (
            text
        )


def test_files_roundtrip_keeps_everything(tmp_path) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(template="{{ bos_token }}x"))
    info = json.loads(json.dumps(tok.write_files(tmp_path / "tokenizer.json")))  # as stored
    again = Tokenizer.from_files(tmp_path / "tokenizer.json", info)
    assert again.encode("hello the wörld") == tok.encode("hello the wörld")
    assert (again.bos_token_id, again.eos_token_ids, again.vocab_size) == (
        tok.bos_token_id,
        tok.eos_token_ids,
        tok.vocab_size,
    )
    assert again.apply_chat_template([]) == "<|im_start|>x"


def test_chat_template_trims_blocks_like_hf() -> None:
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    template = "{% for m in messages %}\n  {% if true %}\n{{ m['content'] }}{% endif %}\n{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(template=template))
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}])
        == "hiyo"
    )


def test_chat_template_matches_transformers_rendering() -> None:
    transformers = pytest.importorskip("transformers")
    template = (
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'system' %}[S]{{ m['content'] }}"
        "{% else %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"
    )
    meta = _byte_level_meta(template=template)
    ours = Tokenizer.from_gguf_metadata(meta)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, eos_token="<|im_end|>", chat_template=template
    )
    messages = [{"role": "system", "content": "be <brief> & kind"}, {"role": "user", "content": "  héllo  "}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<&>"}}]
    for kw in ({}, {"tools": tools}):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kw) == expected


def test_chat_template_raise_exception_is_a_template_error() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}"
        "{% endif %}ok"
    )
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_has_strftime_now_and_no_template_means_error() -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(template="{{ strftime_now('%Y') }}"))
    assert tok.apply_chat_template([]).isdigit()
    bare = Tokenizer.from_gguf_metadata(_byte_level_meta())
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_gguf_tokenizer_is_refused() -> None:
    meta = _byte_level_meta()
    meta["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(ValueError, match="rwkv"):
        Tokenizer.from_gguf_metadata(meta)


# --- bundled: our ids equal transformers' GGUF tokenizer -----------------------------------------

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Ünïcödé façade — naïve café; 日本語のテキスト; emoji 🙂🚀 and Ελληνικά.",
    "  leading spaces,\ttabs\t\tand\n\nnewlines   trailing   ",
    "numbers 1234567890 3.14159 and code: def f(x): return x**2  # ok",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "<start_of_turn>user\nturn markers<end_of_turn>",
]


@pytest.mark.bundled
@pytest.mark.timeout(1800)  # the first run converts the GGUF with transformers (minutes); later runs seconds
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_bundled_tokenizer_matches_transformers(name, bundled_pair) -> None:
    ours, _, hf_tok = bundled_pair(name)
    tok = ours.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert (
            tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
        ), text
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False), (
            text
        )


@pytest.mark.bundled
@pytest.mark.timeout(1800)
def test_bundled_smollm2_chat_template_matches_transformers(bundled_pair) -> None:
    ours, _, hf_tok = bundled_pair("smollm2-135m-instruct")
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Héllo 🙂"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again"},
        ],
    ]
    for messages in conversations:
        text = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert (
            ours.tokenizer.encode(text, add_special_tokens=False)
            == hf_tok(text, add_special_tokens=False)["input_ids"]
        )
    assert ours.tokenizer.has_chat_template
    assert ours.tokenizer.eos_token_ids[0] == hf_tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.bundled
def test_bundled_gemma_is_a_base_model(bundled_model) -> None:
    tok = bundled_model("gemma-3-270m").tokenizer
    assert not tok.has_chat_template
    assert tok.bos_token_id == 2 and 1 in tok.eos_token_ids
    assert tok.encode("hi")[0] == 2
