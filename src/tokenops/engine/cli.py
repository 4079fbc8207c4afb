"""The `tokenops engine` command: load a model and serve it over the OpenAI-compatible API.

This module only turns command-line options into a loaded model, an `EngineConfig` and a running
uvicorn server. torch, the model loader and the server are imported inside the command body, so
that `tokenops --help` stays instant.
"""

from __future__ import annotations

import re
from typing import Annotated

import typer

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes (K/M/G/T are binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise typer.BadParameter(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** "_kmgt".index(unit)) if unit else int(value)


def engine_command(
    model: str = typer.Option(
        "smollm2-135m-instruct",
        "--model",
        "-m",
        help="A bundled model name (smollm2-135m-instruct, gemma-3-270m), a local HF folder or a .gguf file.",
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("float32", help="Weights and KV cache dtype: float32, bfloat16 or float16."),
    max_num_seqs: int = typer.Option(64, help="Most requests in the running batch."),
    max_num_batched_tokens: int = typer.Option(
        512, help="Token budget of one engine step (prefill chunks + decodes)."
    ),
    max_chunk_tokens: int | None = typer.Option(
        None, help="Most tokens one prompt's prefill takes in a step (default: the whole step budget)."
    ),
    max_prefill_step_tokens: int | None = typer.Option(
        None,
        help="Token budget of a step with no decode running: its first prompt runs in one chunk up to "
        "this many tokens (at or below --max-num-batched-tokens: off; default 1024 on CPUs with AMX, "
        "else off).",
    ),
    block_size: int = typer.Option(16, help="Tokens per KV cache block."),
    kv_cache_memory: str = typer.Option("512MiB", help="Memory for the KV cache pool (e.g. 512MiB, 2GiB)."),
    num_kv_blocks: int | None = typer.Option(
        None, help="Exact KV pool size in blocks (overrides --kv-cache-memory)."
    ),
    max_model_len: int | None = typer.Option(None, help="Context window (default: the model's)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable the prefix cache."),
    quantization: str | None = typer.Option(
        None,
        help="Quantisation of the linear layers: int8 or int4 (weight-only), int8_dynamic (W8A8: int8 "
        "weights and activations, fbgemm, CPU; fastest at batches of 8-32), or bf16 (weights held as "
        "bf16: half the bytes, near-float32 output), or auto (from a table per CPU feature set: int4 on "
        "AVX2 and AVX-512 with BF16 or AMX, else none; docs/engine-core.md) (default: none).",
    ),
    quantization_group_size: int = typer.Option(
        32, help="int4 group of input columns per scale: 32, 64 or 128."
    ),
    gguf_native: bool = typer.Option(
        False,
        "--gguf-native",
        help="With --quantization int4 and a GGUF model: take the file's Q4_0/Q4_1/Q4_K blocks as the int4 "
        "weights (no dequantise/re-quantise, no dequantisation cache).",
    ),
    kv_cache_dtype: str = typer.Option(
        "auto",
        help="KV cache storage: float32, bfloat16, float16 (attention still computes in float32), int8 "
        "(per token-head scales), or auto: the model's dtype, but bfloat16 with --quantization bf16 / "
        "int8_dynamic / int4 on CPUs with native bf16, and with int4 on the block kernels (AVX2 too).",
    ),
    no_derived_weights: bool = typer.Option(
        False,
        "--no-derived-weights",
        help="No prepacked / transposed weight copies (saves one copy of the weights; slower CPU decode).",
    ),
    kv_sink_tokens: int | None = typer.Option(
        None, help="KV eviction: first tokens whose KV is always kept (set with --kv-window-tokens)."
    ),
    kv_window_tokens: int | None = typer.Option(
        None, help="KV eviction: keep only the sinks and this many recent tokens' KV (default: keep all)."
    ),
    speculative: str | None = typer.Option(
        None,
        help="Speculative decoding: 'ngram' (prompt lookup), 'draft' (with --speculative-draft), or a JSON "
        'object of settings, e.g. \'{"method": "ngram", "num_tokens": 6}\' (default: off).',
    ),
    num_speculative_tokens: int | None = typer.Option(
        None, help="Most draft tokens per sequence per step (default 4); adapts to the acceptance rate."
    ),
    speculative_draft: str | None = typer.Option(
        None,
        help="Draft model for --speculative draft: 'self:N' (the target's first N layers), "
        "or a smaller model with the same tokenizer (bundled name, HF folder or .gguf file).",
    ),
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="Name(s) clients use in 'model' (repeatable; default: the model's name)."),
    ] = None,
    default_max_tokens: int | None = typer.Option(
        None, help="max_tokens for requests that give none (default: the rest of the context window)."
    ),
    reasoning_markers: str = typer.Option(
        "auto",
        help="Thinking markers: auto (detect <think>/</think> from the tokenizer and chat template), "
        "none, or START,END.",
    ),
    reasoning_effort_budget: Annotated[
        list[str] | None,
        typer.Option(
            help="Thinking budget of a reasoning_effort value, EFFORT=TOKENS or EFFORT=none (repeatable); "
            "defaults: none=0 minimal=256 low=1024 medium=8192 high=24576."
        ),
    ] = None,
    role: str = typer.Option(
        "both",
        help="Prefill/decode disaggregation: prefill (answers prefill legs, holds their KV for a decode "
        "engine), decode (pulls a prefill engine's KV, then decodes), "
        "or both (today's engine, takes either leg).",
    ),
    engine_id: str = typer.Option("", help="This engine's id in kv_transfer_params (default: a random one)."),
    kv_transfer_port: int = typer.Option(
        0, help="TCP port of the KV transfer stream (default: any free port; /v1/load reports it)."
    ),
    kv_hold_timeout: float = typer.Option(
        60.0, help="Seconds a prefill leg's KV is held for its decode leg."
    ),
    expert_server: Annotated[
        list[str] | None,
        typer.Option(
            help="MoE models: an expert server HOST:PORT (`tokenops expert-server`, "
            "repeatable); the routed experts run there, with failover between replicas."
        ),
    ] = None,
    expert_registry: str | None = typer.Option(
        None,
        help="MoE models: HOST:PORT where expert servers started with `--register` announce themselves; "
        "serving starts once every expert has a server (waits up to --expert-wait seconds).",
    ),
    expert_wait: float = typer.Option(60.0, help="Seconds to wait for expert servers to register."),
    expert_overlap: bool = typer.Option(
        False,
        help="With expert servers: run each step as two micro-batches, one's attention computed while "
        "the other's experts are on the servers (double batching).",
    ),
    tool_parser: str | None = typer.Option(
        None,
        help="How tool calls are read from the model's text: hermes, llama3_json or mistral "
        "(default: chosen from the chat template).",
    ),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve a model with the embedded engine: /v1/chat/completions, /v1/completions, /metrics, /v1/load."""
    import logging

    import uvicorn

    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.kv_cache import kv_dtype_name
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.engine.reasoning import ReasoningMarkers, parse_effort_budgets
    from tokenops.engine.server import ServerConfig, build_app
    from tokenops.engine.speculative import SpeculativeConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        torch_dtype = resolve_dtype(dtype)
        spec = None
        if speculative:
            settings = SpeculativeConfig.settings_from_text(speculative)
            if num_speculative_tokens is not None:
                settings["num_tokens"] = num_speculative_tokens
            if speculative_draft is not None:
                settings["draft_model"] = speculative_draft
            spec = SpeculativeConfig.from_value(settings)
        elif num_speculative_tokens is not None or speculative_draft is not None:
            raise ValueError("--num-speculative-tokens and --speculative-draft need --speculative")
        config = EngineConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=parse_size(kv_cache_memory),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_chunk_tokens=max_chunk_tokens,
            max_prefill_step_tokens=max_prefill_step_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=not no_prefix_caching,
            device=device,
            quantization=quantization,
            quantization_group_size=quantization_group_size,
            gguf_native=gguf_native,
            kv_cache_dtype=kv_cache_dtype,
            derived_weights=not no_derived_weights,
            kv_eviction=None
            if kv_window_tokens is None
            else {
                "sink_tokens": 4 if kv_sink_tokens is None else kv_sink_tokens,
                "window_tokens": kv_window_tokens,
            },
            speculative=spec,
            kv_hold_timeout_s=kv_hold_timeout,
        )
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"--role must be prefill, decode or both, got {role!r}")
        effort_budgets = parse_effort_budgets(reasoning_effort_budget or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"loading {model} on {device} ({dtype}) ...", err=True)
    try:
        # with expert servers the routed experts are theirs: the engine never loads them
        loaded = load_model(
            model,
            device=device,
            dtype=torch_dtype,
            gguf_native=config.gguf_native,
            routed_experts=not (expert_server or expert_registry),
        )
    except ValueError as exc:  # --gguf-native with a Hugging Face folder: name the flag
        if not (config.gguf_native and "gguf_native" in str(exc)):
            raise
        raise typer.BadParameter(str(exc), param_hint="--gguf-native") from None
    try:
        markers = ReasoningMarkers.parse(loaded.tokenizer, reasoning_markers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--reasoning-markers") from None
    try:
        engine = LLMEngine.from_loaded(loaded, config)
    except ValueError as exc:  # e.g. a KV pool too small for the eviction window
        raise typer.BadParameter(str(exc)) from None
    # after the engine is built: its --quantization has given the experts their format, which the
    # servers' fingerprints must match
    if expert_server or expert_registry:
        from tokenops.engine.eaas.client import connect_expert_servers

        try:
            connect_expert_servers(
                loaded.model,
                expert_server or [],
                registry=expert_registry,
                wait_s=expert_wait if expert_registry else 0.0,
                overlap=expert_overlap,
            )
        except ValueError as exc:  # not an MoE model, or a server refused at registration
            raise typer.BadParameter(str(exc), param_hint="--expert-server") from None
    names = served_model_name or [loaded.name]
    app = build_app(
        engine,
        loaded.tokenizer,
        ServerConfig(
            served_model_names=list(names),
            max_model_len=engine.max_model_len,
            model_path=str(loaded.path),
            default_max_tokens=default_max_tokens,
            reasoning_markers=markers,
            reasoning_effort_budgets=effort_budgets,
            role=role,
            engine_id=engine_id,
            kv_transfer_host=host,
            kv_transfer_port=kv_transfer_port,
            tool_parser=tool_parser,
        ),
    )
    typer.echo(
        f"serving {', '.join(names)} on http://{host}:{port}/v1 "
        f"(context {engine.max_model_len} tokens, {engine.pool.num_blocks} KV blocks of {block_size}, "
        f"KV {kv_dtype_name(engine.kv_dtype)}: {engine.kv_bytes_per_token} bytes/token, "
        f"weights {config.quantization or 'as loaded'}, "
        f"role {role}" + (f", thinking in {markers.start_text}...{markers.end_text})" if markers else ")"),
        err=True,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
