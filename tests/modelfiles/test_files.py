"""The torch-free model files module: spec resolution and the GGUF tokenizer cache.

Tiny GGUF files holding only tokenizer metadata (the two hand-written vocabularies of
`test_tokenizer`: byte-level BPE with merges and specials, SentencePiece BPE with byte fallback) are
written with gguf-py; the tokenizer read back from the cache must encode, decode and render exactly
as the one rebuilt from the metadata, a cache entry that is damaged or stale in any way is rebuilt
with a warning, and a cache that cannot be written only warns. The bundled tests (marked `bundled`)
compare the cached and the rebuilt tokenizer of both bundled models.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import Tokenizer as RustTokenizer

from tokenops.modelfiles import files
from tokenops.modelfiles.files import (
    GGUFHeader,
    ModelNotFoundError,
    gguf_tokenizer,
    parse_gguf,
    resolve_model,
    tokenizer_entry,
)
from tokenops.modelfiles.tokenizer import Tokenizer

from .test_tokenizer import TEXTS, _byte_level_meta, _spm_meta

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}{{ eos_token }}"
PROBES = TEXTS + [
    "hello the wörld 🙂  42\n<think>",
    "héllo wörld \x00\x7f bytes ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # byte fallback and 4-byte characters
    "hello world",
    "",
]


def write_tokenizer_gguf(path: Path, meta: dict, tensors: dict | None = None) -> Path:
    """A GGUF file with `meta` as its metadata and `tensors` (name -> float32 array), none by default."""
    import gguf

    writer = gguf.GGUFWriter(str(path), meta["general.architecture"])
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def entry_of(cache: Path, path: Path) -> Path:
    """The tokenizer cache entry of a GGUF file: keyed by its header's sha256."""
    return tokenizer_entry(cache, GGUFHeader(path, vocabulary=False).sha256())


def _meta(kind: str) -> dict:
    meta = _byte_level_meta(template=TEMPLATE) if kind == "byte_level" else _spm_meta()
    if kind == "sentencepiece":
        meta["tokenizer.chat_template"] = (
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        )
    return meta


def assert_same_tokenizer(a: Tokenizer, b: Tokenizer, texts: list[str]) -> None:
    assert (a.bos_token_id, a.eos_token_ids, a.vocab_size) == (b.bos_token_id, b.eos_token_ids, b.vocab_size)
    assert (a.special_tokens, a.chat_template) == (b.special_tokens, b.chat_template)
    assert a.backend.get_added_tokens_decoder() == b.backend.get_added_tokens_decoder()
    for text in texts:
        for specials in (True, False):
            ids = a.encode(text, add_special_tokens=specials)
            assert ids == b.encode(text, add_special_tokens=specials), (text, specials)
            for skip in (True, False):
                assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip), (
                    text
                )
    every = list(range(a.vocab_size))
    assert a.decode(every, skip_special_tokens=False) == b.decode(every, skip_special_tokens=False)
    if a.has_chat_template:
        messages = [{"role": "user", "content": "héllo 🙂"}, {"role": "assistant", "content": "hi"}]
        assert a.apply_chat_template(messages) == b.apply_chat_template(messages)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_cached_tokenizer_equals_the_rebuilt_one(kind, tmp_path) -> None:
    meta = _meta(kind)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    rebuilt = Tokenizer.from_gguf_metadata(parse_gguf(path)[0])
    cache = tmp_path / "cache"

    first = gguf_tokenizer(path, cache)  # rebuilt, and written
    entry = entry_of(cache, path)
    assert sorted(p.name for p in entry.iterdir()) == ["tokenizer.json", "tokenops.json"]
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary leftovers
    RustTokenizer.from_file(str(entry / "tokenizer.json"))  # the tokenizers library's own file
    second = gguf_tokenizer(path, cache)
    assert_same_tokenizer(second, rebuilt, PROBES)
    assert_same_tokenizer(first, rebuilt, PROBES)


def test_a_valid_entry_is_what_a_warm_start_loads(tmp_path) -> None:
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", _meta("byte_level"))
    cache = tmp_path / "cache"
    gguf_tokenizer(path, cache)
    entry = entry_of(cache, path)
    info = json.loads((entry / "tokenops.json").read_text())
    info.pop("entry_sha256")
    info["chat_template"] = "from the cache"
    info["entry_sha256"] = files._entry_digest((entry / "tokenizer.json").read_bytes(), info)
    (entry / "tokenops.json").write_text(json.dumps(info))
    assert gguf_tokenizer(path, cache).apply_chat_template([]) == "from the cache"
    # use_cache=False never reads it
    assert gguf_tokenizer(path, cache, use_cache=False).chat_template == TEMPLATE


def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _resign(entry: Path, edit) -> None:
    """Change tokenops.json and record a matching sha256: a consistent entry, but stale."""

    def apply(info: dict) -> None:
        info.pop("entry_sha256")
        edit(info)
        info["entry_sha256"] = files._entry_digest((entry / "tokenizer.json").read_bytes(), info)

    _edit_json(entry / "tokenops.json", apply)


DAMAGE = {
    # still valid JSON that loads, and wrong: a special token made plain, a merge dropped
    "special token made plain": lambda e: (e / "tokenizer.json").write_text(
        (e / "tokenizer.json").read_text().replace('"special":true', '"special":false', 1)
    ),
    "merge dropped": lambda e: (e / "tokenizer.json").write_text(
        (e / "tokenizer.json").read_text().replace(',["ll","o"]', "", 1)
    ),
    # a token renamed: the merges name a token the vocabulary lacks, so it does not load
    "token renamed": lambda e: (e / "tokenizer.json").write_text(
        (e / "tokenizer.json").read_text().replace('"llo"', '"llx"', 1)
    ),
    "truncated tokenizer.json": lambda e: (e / "tokenizer.json").write_bytes(
        (e / "tokenizer.json").read_bytes()[:500]
    ),
    "missing tokenizer.json": lambda e: (e / "tokenizer.json").unlink(),
    "eos ids edited": lambda e: _edit_json(e / "tokenops.json", lambda i: i.update(eos_token_ids=[5])),
    "garbage tokenops.json": lambda e: (e / "tokenops.json").write_text("{not json"),
    "no digest": lambda e: _edit_json(e / "tokenops.json", lambda i: i.pop("entry_sha256")),
    "other tokenizers version": lambda e: _resign(e, lambda i: i.update(tokenizers="0.0.1")),
    "other format": lambda e: _resign(e, lambda i: i.update(format=0)),
    "other GGUF file": lambda e: _resign(e, lambda i: i.update(gguf_header_sha256="0" * 64)),
    "missing tokenops.json": lambda e: (e / "tokenops.json").unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_stale_entry_is_rebuilt(damage, tmp_path) -> None:
    meta = _meta("byte_level")
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    cache = tmp_path / "cache"
    gguf_tokenizer(path, cache)
    entry = entry_of(cache, path)
    before = (entry / "tokenizer.json").read_text(), (entry / "tokenops.json").read_text()
    DAMAGE[damage](entry)
    assert before != tuple(
        (entry / f).read_text() if (entry / f).exists() else None for f in ("tokenizer.json", "tokenops.json")
    )  # the damage took
    with pytest.warns(UserWarning, match="damaged or stale"):
        tok = gguf_tokenizer(path, cache)
    assert_same_tokenizer(tok, Tokenizer.from_gguf_metadata(meta), PROBES)
    # rewritten: the next start reads it without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_tokenizer(gguf_tokenizer(path, cache), tok, PROBES)


def test_an_unwritable_cache_only_warns(tmp_path) -> None:
    meta = _meta("sentencepiece")
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "gguf-tokenizer").write_text("a file where the cache folder should be")  # root ignores chmod
    with pytest.warns(UserWarning, match="could not write the tokenizer cache entry"):
        tok = gguf_tokenizer(path, cache)
    assert_same_tokenizer(tok, Tokenizer.from_gguf_metadata(meta), PROBES)


def test_threads_missing_one_entry_at_once_all_get_the_tokenizer(tmp_path) -> None:
    """Threads of one process that miss the same entry at once each write a temporary folder of their
    own. They used to share `.{entry}.{pid}.tmp`: one's rmtree deleted another's folder mid-write, and
    the tokenizers library's save then raised a plain Exception that failed the load (the gateway
    then hashed text for good). Every round: no error, no warning, one entry, no leftovers."""
    meta = _meta("byte_level")
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    want = Tokenizer.from_gguf_metadata(meta)
    results: list[Tokenizer] = []
    failures: list[str] = []
    gc.collect()  # earlier tests' garbage goes now, not inside the recorded window
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads' steps as finely as the GIL allows
    try:
        with warnings.catch_warnings(
            record=True
        ) as caught:  # the filters are global: the threads' warnings land here
            warnings.simplefilter("always")
            for round_ in range(20):
                cache = tmp_path / f"cache{round_}"
                barrier = threading.Barrier(4)

                def load(cache: Path = cache, barrier: threading.Barrier = barrier) -> None:
                    barrier.wait()
                    try:
                        results.append(gguf_tokenizer(path, cache))
                    except Exception as exc:  # noqa: BLE001 - the failure the test looks for
                        failures.append(repr(exc))

                threads = [threading.Thread(target=load) for _ in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                entry = entry_of(cache, path)
                assert [p.name for p in entry.parent.iterdir()] == [entry.name], (
                    round_
                )  # no temporary leftovers
    finally:
        sys.setswitchinterval(switch)
    # A ResourceWarning here is another test's leaked socket or loop meeting the collector mid-run
    ours = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
    assert failures == [] and ours == []
    assert len(results) == 80
    for tok in results[:8]:
        assert_same_tokenizer(tok, want, PROBES[:4])


def test_a_writer_keeps_the_complete_entry_another_wrote(tmp_path) -> None:
    """A writer that finds a complete entry in place (another process published it while this one
    rebuilt) discards its own instead of removing that one, which a reader may be loading."""
    meta = _meta("byte_level")
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    cache = tmp_path / "cache"
    gguf_tokenizer(path, cache)
    entry = entry_of(cache, path)
    before = entry.stat().st_ino, {p.name: p.read_bytes() for p in entry.iterdir()}
    late = Tokenizer.from_gguf_metadata(meta)
    late.chat_template = "the late writer's"
    files._write_tokenizer_entry(entry, GGUFHeader(path).sha256(), late)
    assert (entry.stat().st_ino, {p.name: p.read_bytes() for p in entry.iterdir()}) == before
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    assert gguf_tokenizer(path, cache).chat_template == TEMPLATE


def test_installs_with_other_tokenizers_versions_keep_an_entry_each(tmp_path, monkeypatch) -> None:
    """Two installs sharing a cache, with other `tokenizers` versions: each reads its own entry (the
    version is in the name). With one entry for both, each start removed the other's and rebuilt."""
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", _meta("byte_level"))
    cache = tmp_path / "cache"
    ours = tokenizers.__version__
    stamps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "damaged or stale" rebuild warns
        for version in (ours, "0.0.1", ours, "0.0.1", ours):
            monkeypatch.setattr(tokenizers, "__version__", version)
            gguf_tokenizer(path, cache)
            stamps.append(
                {
                    p.name: (p / "tokenops.json").stat().st_mtime_ns
                    for p in (cache / "gguf-tokenizer").iterdir()
                }
            )
    names = {entry_of(cache, path).name.replace(ours, v) for v in (ours, "0.0.1")}
    assert set(stamps[-1]) == names
    assert stamps[1] == stamps[-1]  # both entries written once, then only read


def test_the_entry_is_keyed_by_the_header_alone(tmp_path) -> None:
    """The key is a sha256 of the bytes before the tensor data (the tokenizer depends on the metadata
    alone), so files with the same metadata and other weights share an entry, and getting the
    tokenizer never reads the tensor data: a file whose data is cut off still gives it."""
    meta = _meta("byte_level")
    a = write_tokenizer_gguf(tmp_path / "a.gguf", meta, {"w": np.zeros((64, 64), np.float32)})
    b = write_tokenizer_gguf(tmp_path / "b.gguf", meta, {"w": np.ones((64, 64), np.float32)})
    header = GGUFHeader(a, vocabulary=False)
    assert header.sha256() == hashlib.sha256(a.read_bytes()[: header.data_start]).hexdigest()
    assert files.file_sha256(a) != files.file_sha256(b) and header.sha256() != files.file_sha256(a)
    cache = tmp_path / "cache"
    gguf_tokenizer(a, cache)
    entry = entry_of(cache, a)
    _resign(entry, lambda i: i.update(chat_template="from the entry"))  # what a cache read gives
    assert gguf_tokenizer(b, cache).chat_template == "from the entry"
    with a.open("r+b") as f:
        f.truncate(header.data_start + 10)
    assert gguf_tokenizer(a, cache).chat_template == "from the entry"
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFHeader(a).tensors()


def test_the_header_decodes_the_vocabulary_it_stepped_over(tmp_path) -> None:
    path = write_tokenizer_gguf(
        tmp_path / "tok.gguf", _meta("sentencepiece"), {"w": np.ones((2, 32), np.float32)}
    )
    lean = GGUFHeader(path, vocabulary=False)
    assert lean.meta["tokenizer.ggml.tokens"] is None
    full = parse_gguf(path)[0]
    assert lean.vocabulary_meta() == full and isinstance(full["tokenizer.ggml.tokens"][0], str)


def test_resolve_model(tmp_path) -> None:
    path = write_tokenizer_gguf(tmp_path / "m.gguf", _meta("byte_level"))
    assert resolve_model(str(path)) == files.ModelSource("m", path, "gguf")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "only.gguf").write_bytes(path.read_bytes())
    # a folder holding one GGUF file and no config.json is that file, even with a tokenizer.json beside it
    (folder / "tokenizer.json").write_text("{}")
    assert resolve_model(str(folder)) == files.ModelSource("only", folder / "only.gguf", "gguf")
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == files.ModelSource("folder", folder, "hf")
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve_model(str(tmp_path / "nothing"))


# --- bundled: the cached tokenizer of the real vocabularies -------------------------------------


@pytest.mark.bundled
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_bundled_cached_tokenizer_equals_the_rebuilt_one(name, tmp_path) -> None:
    source = resolve_model(name)
    rebuilt = Tokenizer.from_gguf_metadata(parse_gguf(source.path)[0])
    cache = tmp_path / "cache"
    gguf_tokenizer(source.path, cache)
    assert (entry_of(cache, source.path) / "tokenops.json").is_file()
    cached = gguf_tokenizer(source.path, cache)
    added = [t.content for t in rebuilt.backend.get_added_tokens_decoder().values()]
    texts = PROBES + [
        "".join(added[:300]),
        " ".join(added[-300:]),
        "\u2581 \u2581\u2581  x",
        "\t\r\n\x0b\x1f",
    ]
    assert_same_tokenizer(cached, rebuilt, texts)
    if name == "smollm2-135m-instruct":
        assert cached.has_chat_template
