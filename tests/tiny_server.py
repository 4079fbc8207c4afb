"""A tiny model's OpenAI-compatible engine server for tests: a byte-level tokenizer over the tiny
random models' 256 ids (ids 0-2 special: `<pad>`, `<|im_start|>`, `<|im_end|>` = eos; 3-255 single
bytes; a ChatML template) and a real uvicorn server on a loopback port. The engine's server tests
and the cluster's PD tests share it."""

from __future__ import annotations

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread
from tokenops.modelfiles.tokenizer import _bytes_to_unicode

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ByteTokenizer:
    """tokenops' Tokenizer interface over a 256-id byte-level vocabulary (3 specials + 253 bytes)."""

    SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]

    def __init__(self, chat_template: str | None = CHATML) -> None:
        vocab = {tok: i for i, tok in enumerate(self.SPECIALS)}
        for b, ch in sorted(_bytes_to_unicode().items()):
            if b >= 3:  # bytes 0x00-0x02 are left out to fit 256 ids
                vocab[ch] = b
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._tok.decoder = decoders.ByteLevel()
        self._tok.add_special_tokens(self.SPECIALS)
        self.backend = self._tok  # what structured output builds its token masks from
        self.vocab_size = 256
        self.eos_token_ids = [2]
        self.bos_token_id = None
        self.has_chat_template = chat_template is not None
        self._template = jinja2.Environment().from_string(chat_template or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None
    ) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools
        )


def start_server(model, tokenizer, name: str, **engine_kw):
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    cfg.update(engine_kw)
    engine = LLMEngine(model, EngineConfig(**cfg), eos_token_ids=tokenizer.eos_token_ids)
    # a short default for requests without max_tokens keeps the fuzzed requests quick
    config = ServerConfig(
        served_model_names=[name], max_model_len=engine.max_model_len, default_max_tokens=32
    )
    app = build_app(engine, tokenizer, config)
    return engine, app, serve_in_thread(app)
