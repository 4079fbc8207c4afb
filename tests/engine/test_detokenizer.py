"""Incremental detokenisation and stop strings: streamed deltas concatenate to the whole text.

Two small tokenizers built here with the `tokenizers` library stand for the two families we serve:
a GPT-2 style byte-level BPE (SmolLM2) whose tokens split emoji and CJK characters into bytes, and
a SentencePiece style metaspace BPE with byte fallback (Llama 2 / Gemma) whose decoder strips the
leading space. Each decodes with the real library, so the checks exercise true partial UTF-8.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tokenops.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    OutputText,
    StopStringMatcher,
)

TEXTS = [
    "Hello world, this is plain ASCII text.",
    "emoji 😀🎉👍 mixed in text 🧑‍🤝‍🧑 family",
    "CJK 你好世界, 日本語のテキスト, 한국어 텍스트",
    "accents: déjà vu, naïve, Ünïcödé; math ∑∫√ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


class _Adapter:
    """The decode half of tokenops' Tokenizer, over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        self.tok = tok
        self.eos_token_ids = [eos]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def byte_level() -> _Adapter:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 5, trainer)
    return _Adapter(tok, tok.token_to_id("<eos>"))


@pytest.fixture(scope="module")
def sentencepiece() -> _Adapter:
    # a hand-made vocabulary: bytes first (fallback), then ASCII and a few merges; everything
    # else (emoji, CJK, accents) is spelt as UTF-8 byte tokens
    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["▁"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<eos>"])
    return _Adapter(tok, 1)


def _stream(text_out: OutputText, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 3])
        deltas.append(text_out.add(ids[i : i + step]))
        i += step
    deltas.append(text_out.finish())
    return deltas


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_decoded_text(
    request: pytest.FixtureRequest, family: str, text: str
) -> None:
    tok = request.getfixturevalue(family)
    ids = tok.encode(text)
    assert len(ids) > len(text) // 4
    for seed in range(3):
        deltas = _stream(OutputText(tok), ids, random.Random(seed))
        assert "".join(deltas) == tok.decode(ids) == text
        # no delta ever carries half a character
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_characters_are_split_across_tokens(byte_level: _Adapter) -> None:
    # the premise of the test above: single tokens decode to U+FFFD on their own
    ids = byte_level.encode("😀你")
    assert any(REPLACEMENT_CHAR in byte_level.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(byte_level)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "😀你"
    assert pieces[0] == ""  # the first byte alone is held back


def test_prompt_context_keeps_the_leading_space(sentencepiece: _Adapter) -> None:
    prompt = sentencepiece.encode("say")
    ids = sentencepiece.encode("say hello there")[len(prompt) :]
    # decoded alone the continuation loses its leading space (metaspace strip); in context it keeps it
    assert sentencepiece.decode(ids) == "hello there"
    out = OutputText(sentencepiece, prompt)
    assert "".join(_stream(out, ids, random.Random(0))) == " hello there"


def test_special_tokens_are_skipped(byte_level: _Adapter) -> None:
    ids = byte_level.encode("done") + byte_level.eos_token_ids
    out = OutputText(byte_level)
    assert "".join(_stream(out, ids, random.Random(0))) == "done"


def test_invalid_bytes_are_emitted_after_a_bounded_wait(byte_level: _Adapter) -> None:
    lead = byte_level.encode("😀")[0]  # a lone lead byte never completes
    detok = IncrementalDetokenizer(byte_level)
    out = [detok.push([lead]) for _ in range(20)]
    assert any(out), "pending bytes must not be held forever"
    assert "".join(out) + detok.flush() == byte_level.decode([lead] * 20)


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world, this is plain ASCII text.", ["plain"], "Hello world, this is "),
        ("Hello world, this is plain ASCII text.", ["is", "world"], "Hello "),
        ("Hello world, this is plain ASCII text.", ["nothing"], "Hello world, this is plain ASCII text."),
        ("CJK 你好世界, 日本語のテキスト", ["世界"], "CJK 你好"),
        ("emoji 😀🎉👍 mixed", ["🎉"], "emoji 😀"),
        ("abc ###", ["###"], "abc "),
        ("ends with a partial sto", ["stop"], "ends with a partial sto"),
    ],
)
def test_stop_strings(
    request: pytest.FixtureRequest, family: str, text: str, stops: list[str], expected: str
) -> None:
    tok = request.getfixturevalue(family)
    ids = tok.encode(text)
    for seed in range(3):
        out = OutputText(tok, stop=stops)
        deltas = _stream(out, ids, random.Random(seed))
        assert "".join(deltas) == expected
        assert out.text == expected
        assert out.stopped == (expected != text)
        # nothing is added once stopped
        assert out.add(tok.encode(" more")) == "" and out.finish() == ""


def test_text_that_may_start_a_stop_string_is_held_back(byte_level: _Adapter) -> None:
    out = OutputText(byte_level, stop=["STOP"])
    assert out.add(byte_level.encode("Hello ST")) == "Hello "
    assert out.add(byte_level.encode("O")) == ""
    assert out.add(byte_level.encode("ry")) == "STOry"
    assert out.add(byte_level.encode(" STO")) == " "
    assert out.add(byte_level.encode("P now")) == ""
    assert out.stopped and out.stop_string == "STOP" and out.text == "Hello STOry "


def test_stop_matcher_hold_back_lengths() -> None:
    m = StopStringMatcher(["abc", "xyz!"])
    assert m.held_back("123ab") == 2
    assert m.held_back("123a") == 1
    assert m.held_back("xy") == 2
    assert m.held_back("ab!") == 0
    assert m.find("123abc", 3) == 3
    assert m.find("abc123", 6) == -1  # a match that ended before the new text was seen earlier


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
def bundled_tokenizer(request: pytest.FixtureRequest):
    """The real tokenizers of the bundled models: GPT-2 byte-level BPE and Gemma's SentencePiece."""
    from tokenops.engine.gguf_reader import read_gguf
    from tokenops.modelfiles.bundled import resolve_bundled
    from tokenops.modelfiles.files import default_cache_dir

    return read_gguf(resolve_bundled(request.param, default_cache_dir())).tokenizer


@pytest.mark.bundled
@pytest.mark.parametrize("text", TEXTS)
def test_bundled_tokenizers_stream_exact_text(bundled_tokenizer, text: str) -> None:
    tok = bundled_tokenizer
    prompt = tok.encode("Translate:", add_special_tokens=False)
    ids = tok.encode(" " + text, add_special_tokens=False)
    whole = OutputText(tok, prompt)
    expected = whole.add(ids) + whole.finish()
    assert expected.strip() == text.strip()
    for seed in range(2):
        deltas = _stream(OutputText(tok, prompt), ids, random.Random(seed))
        assert "".join(deltas) == expected
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
    cut = OutputText(tok, prompt, stop=[text[len(text) // 2 : len(text) // 2 + 2]])
    got = "".join(_stream(cut, ids, random.Random(0)))
    assert cut.stopped and expected.startswith(got) and len(got) < len(expected)
