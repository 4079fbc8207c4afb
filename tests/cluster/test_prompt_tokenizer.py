"""The gateway's prompt tokeniser gives the token ids our engine computes, so its block hashes are the
ones the engine's KV events name.

Fixture tokenizers (HF folders written here: a 256-id byte-level vocabulary, so the tiny random Llama can
serve them) are checked against a real engine server: the ids the engine stored in its KV cache (its KV
events carry them) and its usage `prompt_tokens`. Two templates: ChatML with tools rendered into the
system turn, and a Llama-2 style template that writes BOS itself while encoding also adds BOS to plain
text (BOS must appear once in a chat prompt, and once in a text prompt). The bundled SmolLM2 tokenizer,
read by the gateway without weights or torch, is compared with the one the engine's own loader
returns; a GGUF file's tokenizer is cached by the gateway and read back from the cache in a process
that never imports torch, and the gateway resolves a model folder to the file the engine serves.
Fallbacks: no tokenizer, one still loading, one that failed, a model without chat template.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from tokenops.cluster.config import ClusterConfig, build_cluster
from tokenops.cluster.load_poller import parse_engine_kv_events
from tokenops.cluster.prefix_index import (
    KVEventApplier,
    PrefixIndex,
    block_hashes_from_text,
    block_hashes_from_tokens,
)
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
from tokenops.config import ServedModel
from tokenops.gateway.request import PREFIX_BLOCK_TOKENS, parse_request
from tokenops.modelfiles.tokenizer import Tokenizer, _bytes_to_unicode, template_messages
from tokenops.protocol import ChatCompletionRequest

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'system' %}<<SYS>>{{ m.content }}<</SYS>>{% else %} {{ m.content }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

SYSTEM = "You answer questions about the Tokenops help desk, briefly and politely. " * 3
CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How do I rotate my API key?"},
        {"role": "assistant", "content": "Open the keys page."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And then? "}, {"type": "text", "text": "Thanks."}],
        },
    ],
}


def write_tokenizer_folder(folder: Path, template: str, add_bos: bool) -> Path:
    """A HF tokenizer folder with 256 ids: 5 specials, then bytes 0x05-0xff at their own value."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in _bytes_to_unicode().items():
        if b >= len(SPECIALS):
            vocab[ch] = b
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def engine_tokens(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """What the engine server computes for a chat body (its handler's own steps)."""
    req = ChatCompletionRequest.model_validate(body)
    text = tokenizer.apply_chat_template(
        template_messages(req.messages), add_generation_prompt=True, tools=req.tools
    )
    return tokenizer.encode(text, add_special_tokens=False)


# -- a real engine server on the tiny random Llama, with each fixture tokenizer ----------------------


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    import torch

    from tokenops.engine.models import ModelConfig as EngineModelConfig
    from tokenops.engine.models import build_model

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_config).float().eval()
    config = EngineModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(config, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    return model


def serve_engine(model: Any, tokenizer: Tokenizer) -> Any:
    from tokenops.engine.config import EngineConfig
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.server import ServerConfig, build_app, serve_in_thread

    cfg = EngineConfig(
        block_size=4, num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024
    )
    engine = LLMEngine(model, cfg, eos_token_ids=tokenizer.eos_token_ids)
    config = ServerConfig(served_model_names=["m"], max_model_len=engine.max_model_len, default_max_tokens=2)
    return serve_in_thread(build_app(engine, tokenizer, config))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("template", "add_bos", "tools"),
    [(CHATML_TOOLS, False, [{"type": "function", "function": {"name": "rotate_key", "parameters": {}}}]),
     (LLAMA2, True, None)],
    ids=["chatml-tools", "llama2-bos"],
)  # fmt: skip
def test_chat_ids_equal_what_the_engine_caches(
    tiny_llama: Any, tmp_path: Path, template: str, add_bos: bool, tools: list | None
) -> None:
    folder = write_tokenizer_folder(tmp_path / "tok", template, add_bos)
    gateway = PromptTokenizer(str(folder), block_size=4)
    assert gateway.wait(30), gateway.error
    body = {**CHAT, "tools": tools} if tools else dict(CHAT)
    ids = gateway.chat_ids(body)
    assert ids is not None
    assert ids.count(1) == (1 if template == LLAMA2 else 0)  # BOS once: the template's, not encode's too
    if tools:
        assert b"rotate_key" in bytes(i for i in ids if i >= len(SPECIALS))

    engine_tok = Tokenizer.from_hf_folder(folder)  # what the engine's loader builds for an HF folder
    with serve_engine(tiny_llama, engine_tok) as url, httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        # the engine's KV events carry the token ids it stored: every full block of our ids is there
        index = PrefixIndex()
        applier = KVEventApplier(index, "engine")
        for event in parse_engine_kv_events(http.get("/v1/kv_events", params={"since": 0}).json()["events"]):
            applier.apply(event)
        hashes = block_hashes_from_tokens(ids, 4)
        assert len(hashes) == len(ids) // 4 > 20
        assert index.match(hashes) == {"engine": len(hashes)}

        # a text completion: the tokenizer's own special tokens (BOS when it adds one)
        prompt = "Plain text, no template. " * 4
        text_ids = gateway.prompt_ids(prompt)
        assert text_ids is not None and (text_ids[0] == 1) == add_bos
        r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(text_ids)


def test_chat_ids_match_transformers_rendering(tmp_path: Path) -> None:
    """An independent renderer: transformers' apply_chat_template on the same folder."""
    transformers = pytest.importorskip("transformers")
    for name, template, add_bos in (("a", CHATML_TOOLS, False), ("b", LLAMA2, True)):
        folder = write_tokenizer_folder(tmp_path / name, template, add_bos)
        gateway = PromptTokenizer(str(folder))
        assert gateway.wait(30)
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
        )
        hf.chat_template = template
        messages = [
            {
                "role": m["role"],
                "content": m["content"] if isinstance(m["content"], str) else "And then? Thanks.",
            }
            for m in CHAT["messages"]
        ]
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
            want = want["input_ids"]
        assert gateway.chat_ids(CHAT) == list(want)


# -- the bundled model -------------------------------------------------------------------------------


@pytest.mark.bundled
def test_bundled_smollm2_tokenizer_from_gguf_metadata_equals_the_engines() -> None:
    from tokenops.engine.gguf_reader import read_gguf
    from tokenops.modelfiles.bundled import resolve_bundled
    from tokenops.modelfiles.files import default_cache_dir

    gateway = PromptTokenizer("smollm2-135m-instruct")
    assert gateway.wait(120), gateway.error
    engine_tok = read_gguf(resolve_bundled("smollm2-135m-instruct", default_cache_dir())).tokenizer
    for body in (
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "No system prompt: 12 + 30?"}]},
    ):
        ids = gateway.chat_ids(body)
        assert ids == engine_tokens(engine_tok, body)
    # SmolLM2's template adds its default system prompt when there is none: the ids show it
    assert len(gateway.chat_ids(body) or ()) > 20
    text = "Tokens and  spaces\n\tand 1234 digits: ünïcödé."
    assert gateway.prompt_ids(text) == engine_tok.encode(text, add_special_tokens=True)


@pytest.mark.bundled
@pytest.mark.timeout(600)
def test_the_gateway_leaves_the_bundled_files_check_to_the_engine(tmp_path: Path) -> None:
    """For a bundled name the gateway reads the assembled file's header only: a copy whose weights are
    damaged is neither hashed (253 MB for Gemma) nor removed and assembled again by the gateway."""
    import shutil

    from tokenops.modelfiles.bundled import resolve_bundled
    from tokenops.modelfiles.files import GGUFHeader, default_cache_dir

    source = resolve_bundled("gemma-3-270m", default_cache_dir())
    cache = tmp_path / "cache"
    (cache / "bundled").mkdir(parents=True)
    copy = cache / "bundled" / source.name
    shutil.copyfile(source, copy)
    with copy.open("r+b") as f:
        f.seek(GGUFHeader(copy).data_start + 1000)
        f.write(b"damaged weights")
    stamp = copy.stat().st_ino, copy.stat().st_mtime_ns
    tok = PromptTokenizer("gemma-3-270m", cache_dir=cache)
    assert tok.wait(300), tok.error
    assert tok.prompt_ids("Hello world") == tok._tokenizer.encode("Hello world")
    assert (copy.stat().st_ino, copy.stat().st_mtime_ns) == stamp


# -- GGUF files: the engine's resolution and tokenizer cache, without torch -------------------------------


def write_gguf_tokenizer(path: Path, template: str, tensor: bool = False) -> Path:
    """A GGUF file with tokenizer metadata (a byte-level vocabulary with merges and ChatML specials)
    and, with `tensor`, one 256 KiB float32 tensor."""
    import gguf
    import numpy as np

    alphabet = [_bytes_to_unicode()[b] for b in range(256)]
    tokens = alphabet + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 259 + [3, 3])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(260)
    writer.add_chat_template(template)
    if tensor:
        writer.add_tensor("weights", np.arange(256 * 256, dtype=np.float32).reshape(256, 256))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_tokenizer_is_cached_and_read_without_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tokenops.modelfiles.files import parse_gguf

    path = write_gguf_tokenizer(tmp_path / "m.gguf", CHATML_TOOLS)
    cache = tmp_path / "cache"
    script = f"""
import json, sys
from tokenops.cluster.prompt_tokenizer import PromptTokenizer
answers = []
for _ in range(2):  # the first load rebuilds and caches the tokenizer, the second reads the cache
    tok = PromptTokenizer({str(path)!r}, cache_dir={str(cache)!r})
    assert tok.wait(60), tok.error
    answers.append(tok.chat_ids(json.loads({json.dumps(CHAT)!r})))
print(json.dumps({{"ids": answers, "heavy": [m for m in ("torch", "safetensors") if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    want = engine_tokens(Tokenizer.from_gguf_metadata(parse_gguf(path)[0]), CHAT)
    assert result["ids"] == [want, want]
    assert [p.name for p in (cache / "gguf-tokenizer").iterdir()][0].endswith(
        f"-v1-tokenizers{tokenizers.__version__}"
    )


def test_the_gateway_reads_no_more_of_a_gguf_file_than_its_header(tmp_path: Path) -> None:
    """The tokenizer entry is keyed by the sha256 of the file's header, so the gateway finds the entry the
    engine wrote without reading the tensor data: with that data overwritten, then cut off, it still
    gets the tokenizer, from the same entry. (It used to hash the whole file, a 40 GB read for a user's
    model: overwritten data missed the entry and rebuilt, cut-off data failed the parse.)"""
    from tokenops.modelfiles.files import GGUFHeader, gguf_tokenizer, parse_gguf

    path = write_gguf_tokenizer(tmp_path / "m.gguf", CHATML_TOOLS, tensor=True)
    want = engine_tokens(Tokenizer.from_gguf_metadata(parse_gguf(path)[0]), CHAT)
    cache = tmp_path / "cache"
    gguf_tokenizer(path, cache)  # what the engine's load does: the entry is written
    (entry,) = (cache / "gguf-tokenizer").iterdir()
    written = entry.stat().st_ino, (entry / "tokenops.json").stat().st_mtime_ns
    data_start = GGUFHeader(path).data_start
    assert path.stat().st_size >= data_start + 256 * 256 * 4
    with path.open("r+b") as f:
        f.seek(data_start)
        f.write(b"\xff" * (256 * 256 * 4))  # garbage weights
    for _ in range(2):
        tok = PromptTokenizer(str(path), cache_dir=cache)
        assert tok.wait(60), tok.error
        assert tok.chat_ids(CHAT) == want
        assert [
            (e.name, e.stat().st_ino, (e / "tokenops.json").stat().st_mtime_ns)
            for e in entry.parent.iterdir()
        ] == [(entry.name, *written)]
        with path.open("r+b") as f:
            f.truncate(data_start + 100)  # then no weights at all


def test_the_gateway_reads_the_file_the_engine_serves(tmp_path: Path) -> None:
    """A folder holding one GGUF file and no config.json is served from the GGUF file by the engine,
    even with a tokenizer.json beside it; the gateway used to take the tokenizer.json."""
    from tokenops.modelfiles.files import parse_gguf, resolve_model

    folder = write_tokenizer_folder(tmp_path / "model", LLAMA2, True)
    gguf_file = write_gguf_tokenizer(folder / "m.gguf", CHATML_TOOLS)
    assert resolve_model(str(folder)).path == gguf_file
    tok = PromptTokenizer(str(folder), cache_dir=tmp_path / "cache")
    assert tok.wait(60), tok.error
    assert tok.chat_ids(CHAT) == engine_tokens(Tokenizer.from_gguf_metadata(parse_gguf(gguf_file)[0]), CHAT)


# -- fallbacks -----------------------------------------------------------------------------------------


def test_without_a_tokenizer_prompts_are_hashed_as_text() -> None:
    cluster = build_cluster({"remote": ServedModel(backends=["http://127.0.0.1:9/v1"])}, ClusterConfig())
    assert cluster.pools["remote"].prompt_tokenizer is None
    inbound = parse_request("chat", json.dumps(CHAT).encode(), None)
    hashes, block_tokens = inbound.prompt_blocks(None)
    assert (
        block_tokens == PREFIX_BLOCK_TOKENS
        and hashes[0] == block_hashes_from_text(f"<system>{SYSTEM}", 64)[0]
    )


def test_models_get_a_tokenizer_from_their_engine_or_the_tokenizer_key(tmp_path: Path) -> None:
    folder = write_tokenizer_folder(tmp_path / "tok", CHATML_TOOLS, False)
    models = {
        "local": ServedModel(engine={"model": str(folder), "args": {"block_size": 32}}),
        "remote": ServedModel(backends=["http://10.0.0.1:8000/v1"], tokenizer=str(folder)),
        "plain": ServedModel(backends=["http://10.0.0.2:8000/v1"], tokenizer=str(folder)),
    }
    cluster = build_cluster(models, ClusterConfig(models={"plain": {"policy": "least_outstanding"}}))
    local, remote = cluster.pools["local"].prompt_tokenizer, cluster.pools["remote"].prompt_tokenizer
    assert local is not None and local.source == str(folder) and local.block_size == 32
    assert remote is not None and remote.block_size == 16
    assert cluster.pools["plain"].prompt_tokenizer is None  # its policy never reads prefixes: nothing loads
    # local engines report their KV caches and the gateway hashes their blocks: exact mode by default;
    # a remote backend of unknown kind keeps learning from decisions
    assert cluster.pools["local"].policy.learn is False and cluster.pools["remote"].policy.learn is True
    assert local.state == "idle"  # lazily: nothing is read before the first request

    inbound = parse_request("chat", json.dumps(CHAT).encode(), None)
    first, block_tokens = inbound.prompt_blocks(local)  # starts loading, hashes text meanwhile
    assert block_tokens == PREFIX_BLOCK_TOKENS and first == inbound.prompt_blocks(None)[0]
    assert local.wait(30)
    hashes, block_tokens = inbound.prompt_blocks(local)
    assert block_tokens == 32 and hashes == tuple(block_hashes_from_tokens(local.chat_ids(CHAT) or [], 32))
    assert cluster.status()["local"]["prompt_tokenizer"]["state"] == "ready"
    # a prompt given as token ids needs no tokenizer, but is hashed in the engine's block size
    ids = parse_request(
        "completion", json.dumps({"model": "local", "prompt": list(range(70))}).encode(), None
    )
    assert len(ids.prompt_blocks(local)[0]) == 2


def test_starting_the_cluster_loads_the_prompt_tokenizers(tmp_path: Path) -> None:
    """Loading begins while replicas start, so the first requests need not hash text."""
    import asyncio

    folder = str(write_tokenizer_folder(tmp_path / "tok", CHATML_TOOLS, False))
    models = {"m": ServedModel(backends=["http://127.0.0.1:9/v1"], tokenizer=folder)}
    cluster = build_cluster(models, ClusterConfig())
    tok = cluster.pools["m"].prompt_tokenizer
    assert tok is not None and tok.state == "idle"

    async def start_and_close() -> None:
        await cluster.start()
        await cluster.aclose()

    asyncio.run(start_and_close())
    assert tok.state in ("loading", "ready") and tok.wait(30)


def test_exact_mode_is_the_default_only_where_engines_report_and_tokens_are_known(tmp_path: Path) -> None:
    folder = str(write_tokenizer_folder(tmp_path / "tok", CHATML_TOOLS, False))
    url = "http://10.0.0.1:8000/v1"
    models = {
        "ours": ServedModel(backends=[url], tokenizer=folder),
        "told": ServedModel(backends=[url], tokenizer=folder),
        "blind": ServedModel(backends=[url]),  # our engine, but no tokenizer: text hashes never match
        "kv": ServedModel(backends=[url], tokenizer=folder),
    }
    kinds = {"kinds": {url: "tokenops"}}
    config = ClusterConfig(
        models={
            "ours": kinds,
            "told": {**kinds, "policy_options": {"learn": True}},
            "blind": kinds,
            "kv": {**kinds, "policy": "kv_aware"},
        }
    )
    pools = build_cluster(models, config).pools
    assert pools["ours"].policy.learn is False and pools["kv"].policy.learn is False
    assert pools["told"].policy.learn is True and pools["blind"].policy.learn is True


def test_a_tokenizer_that_cannot_load_or_render_falls_back_to_text(tmp_path: Path) -> None:
    missing = PromptTokenizer(str(tmp_path / "nowhere"))
    assert not missing.wait(10) and missing.state == "failed" and "nowhere" in (missing.error or "")
    inbound = parse_request("chat", json.dumps(CHAT).encode(), None)
    assert inbound.prompt_blocks(missing) == inbound.prompt_blocks(None)

    strict = write_tokenizer_folder(tmp_path / "strict", "{{ raise_exception('no system role') }}", False)
    tok = PromptTokenizer(str(strict))
    assert tok.wait(30) and tok.chat_ids(CHAT) is None  # the engine would refuse it with a 400
    assert tok.prompt_ids("text completions still tokenise") is not None
    chatml = PromptTokenizer(str(write_tokenizer_folder(tmp_path / "chatml", CHATML_TOOLS, False)))
    assert chatml.wait(30) and chatml.chat_ids(CHAT) is not None
    reserved = {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert chatml.chat_ids(reserved) is None  # the engine refuses it
    assert chatml.chat_ids({"model": "m", "messages": "not a list"}) is None  # nor valid

    bare = write_tokenizer_folder(tmp_path / "bare", "", False)  # a base model: no chat template
    base = PromptTokenizer(str(bare))
    assert base.wait(30) and base.chat_ids(CHAT) is None and base.prompt_ids("hello") is not None


def test_loading_happens_once_in_the_background(tmp_path: Path) -> None:
    folder = write_tokenizer_folder(tmp_path / "tok", CHATML_TOOLS, False)
    tok = PromptTokenizer(str(folder))
    answers = [tok.chat_ids(CHAT) for _ in range(20)]  # first uses start one load and do not wait for it
    loaders = [t for t in threading.enumerate() if t.name == f"tokenizer {folder}"]
    assert len(loaders) <= 1 and tok.state in ("loading", "ready")
    assert tok.wait(30) and tok.chat_ids(CHAT) is not None
    assert answers[0] is None  # the very first request hashed text: nothing was loaded yet


# -- the piece cache -----------------------------------------------------------------------------------

PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "im_end|>", "\n", " ", "  ", "\t",
          "system", "user", "Hello", " world", "12345", "3.14", "ünïcödé", "日本語", "😀", "'s", "don't",
          "\n\n", "<", "|>"]  # fmt: skip


@pytest.mark.bundled
def test_the_piece_cache_gives_the_tokenizers_own_ids() -> None:
    """Texts built from added tokens, their fragments, whitespace, digits and unicode, encoded twice
    (the second time from the cache) and compared with one whole-text encode of the bundled tokenizer."""
    import random

    gateway = PromptTokenizer("smollm2-135m-instruct")
    assert gateway.wait(120), gateway.error
    tok, segments = gateway._tokenizer, gateway._segments
    assert tok is not None and segments is not None and segments._split is not None
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        want = tok.encode(text, add_special_tokens=False)
        assert segments.encode(text) == want, text
        assert segments.encode(text) == want, text  # from the cache
    assert 0 < segments.tokens == sum(len(ids) for ids in segments._cache.values()) <= segments.max_tokens


def test_the_piece_cache_is_bounded_and_off_for_non_literal_added_tokens(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    from tokenops.cluster.prompt_tokenizer import SegmentEncoder

    folder = write_tokenizer_folder(tmp_path / "tok", CHATML_TOOLS, False)
    segments = SegmentEncoder(Tokenizer.from_hf_folder(folder), max_tokens=128)  # pieces of 1 and 15 tokens
    for i in range(10):
        text = f"<|im_start|>user\nquestion {i}<|im_end|>\n"
        assert segments.encode(text) == segments.backend.encode(text, add_special_tokens=False).ids
    assert 128 - 15 < segments.tokens == sum(len(ids) for ids in segments._cache.values()) <= 128
    assert "user\nquestion 9" in segments._cache and "user\nquestion 0" not in segments._cache  # LRU
    long = "x" * 17  # more than an eighth of the bound: encoded, not kept
    assert segments.encode(long) == [ord("x")] * 17 and long not in segments._cache
    stripping = Tokenizer.from_hf_folder(folder)
    stripping.backend.add_special_tokens([AddedToken("<tool>", rstrip=True)])  # eats the spaces after it
    assert SegmentEncoder(stripping)._split is None
    assert SegmentEncoder(stripping).encode("<tool>   x") == stripping.encode(
        "<tool>   x", add_special_tokens=False
    )


def test_the_piece_cache_is_off_where_pieces_encode_differently_alone(tmp_path: Path) -> None:
    """Metaspace with prepend_scheme="first" (Llama 2, Mistral, TinyLlama): a piece encoded on its own
    starts a text and gets a leading "▁" that the same piece after an added token does not get, so the
    piece cache would give other ids than the engine; the encoder must notice and encode whole texts."""
    from tokenops.cluster.prompt_tokenizer import SegmentEncoder

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in "▁abcdefghijklmnopqrstuvwxyz\n":
        vocab.setdefault(ch, len(vocab))
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.add_special_tokens(SPECIALS)
    folder = tmp_path / "metaspace"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TOOLS}))
    tokenizer = Tokenizer.from_hf_folder(folder)
    text = "<|im_start|>user\nhi there<|im_end|>\n"
    whole = tokenizer.encode(text, add_special_tokens=False)
    piecewise = [3, *tokenizer.encode("user\nhi there", add_special_tokens=False), 4,
                 *tokenizer.encode("\n", add_special_tokens=False)]  # fmt: skip
    assert piecewise != whole  # the premise: this tokenizer is one the piece cache would get wrong
    segments = SegmentEncoder(tokenizer)
    assert segments._split is None
    assert segments.encode(text) == whole
