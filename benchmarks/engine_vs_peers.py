"""Our engine vs Hugging Face transformers, llama.cpp and vLLM, side by side, one run.

What is compared, on the same model file (SmolLM2-135M-Instruct, the bundled Q4_1 GGUF), the same
prompt token ids, greedy decoding, the same thread count and a fixed output length (EOS ignored):
- ours: the in-process `LLMEngine` (no HTTP), all requests of a level added at once, then stepped
  to completion (continuous batching, paged KV, prefix cache on); with `--quantization
  none,int8,int4,int8_dynamic` one such peer per weight format (ours, ours-int8, ours-int4, ...),
  and with `--kv-cache-dtype float32,bfloat16` one per KV cache dtype too (ours-bf16-kvfp32,
  ours-bf16-kvbf16; "auto" adds no suffix; the JSON's settings name each peer's KV storage);
- ours-http: the same engine behind its server (`tokenops engine` in a subprocess), all requests of
  a level sent at once as streaming `/v1/completions` calls by the openai SDK: what a client sees;
- transformers: `model.generate` on the whole batch (left padding), weights dequantised by
  transformers' own GGUF loader to float32;
- llamacpp: llama.cpp on the GGUF file itself (Q4_1 kernels), in a subprocess with another
  interpreter (benchmarks/llamacpp_worker.py): all requests of a level in one multi-sequence
  context, continuous batching through `llama_decode` as llama-server's parallel slots do;
  llamacpp-serial: the same requests one at a time, as a request-at-a-time loop serves them;
- vllm-<dtype>: vLLM's CPU build (`make vllm-env`: its own venv and an HF folder written from the same
  GGUF, float32 weights), its OpenAI server in a subprocess driven by the same streaming clients as
  ours-http, one server per `--vllm-dtypes` entry, with `--threads` OpenMP threads bound to the first
  cores (VLLM_CPU_OMP_THREADS_BIND), prefix caching on, its default CPU block size and a
  `--vllm-kv-cache-gib` KV cache.

For each concurrency level (default 1, 8, 32) it reports output tokens/s and TTFT / TPOT
percentiles; then TTFT of a prompt whose first ~1,000 tokens are in the prefix cache vs the same
prompt cold. Every figure is the median over `--repeats` runs (fresh, never-seen prompts each run);
ratios are ours / peer: of those medians, and tokens/s also per repeat (`..._paired`: median, min and
max of repeat i over repeat i). Within a repeat each level runs every in-process and HTTP peer back
to back, in reverse order on odd repeats, so a pair's two runs are seconds apart and a VM whose pace
drifts within minutes mostly cancels in the pair; llama.cpp's subprocess runs its levels after them.
It also prints how many of llama.cpp's first greedy tokens equal ours on one prompt (Q4_1 in
llama.cpp multiplies with int8-quantised activations, so equality is not expected).
Results print as a table and go to a JSON file.

llama.cpp never goes into the project's .venv: `make bench-llamacpp-env` builds a separate venv
(.venv-llamacpp) with the prebuilt llama-cpp-py-sync wheel; llama-cpp-python's `llama_cpp` is used
instead when that is what `--llamacpp-python` has (serial only). Without either, llama.cpp is skipped;
without `make vllm-env`, vLLM is.

Run:  .venv/bin/python benchmarks/engine_vs_peers.py [--repeats 3] [--quantization none,int4] \\
          [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("llamacpp_worker.py")

CORPUS = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers "
    "of stone carried lanterns, then mirrors, then the great Fresnel lenses that bent light into beams "
    "visible for miles. Keepers trimmed wicks, polished brass and logged the weather every hour. "
    "Storms tested them; some towers fell, others stood for centuries. Today most lights are automatic, "
    "yet people still visit them to climb the stairs and look out over the water. "
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def paired_ratios(mine: list[dict[str, float]], peer: list[dict[str, float]], key: str) -> dict[str, float]:
    """`key` of repeat i of `mine` over repeat i of `peer`: median, min and max ({} if the repeats do not
    pair up). A repeat runs every peer back to back, so what the machine's pace does between repeats
    moves both sides of a pair alike; the ratio of two medians can pair a fast repeat with a slow one."""
    if len(mine) != len(peer) or not mine:
        return {}
    r = sorted(a[key] / b[key] for a, b in zip(mine, peer, strict=True) if b[key] > 0)
    return {"median": statistics.median(r), "min": r[0], "max": r[-1]} if r else {}


def summarise(ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p90_s": percentile(tpot, 0.9),
        "tpot_p99_s": percentile(tpot, 0.99),
        "wall_s": wall,
    }


def make_prompts(tokenizer: Any, tag: str, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids (a unique head, then corpus text)."""
    body = tokenizer.encode(CORPUS * (2 + length // 60), add_special_tokens=False)
    prompts = []
    for i in range(count):
        head = tokenizer.encode(f"Note {tag}-{i}: ", add_special_tokens=False)
        off = (i * 7) % 50
        prompts.append((head + body[off : off + length])[:length])
    return prompts


# ---------------------------------------------------------------------------------------------
# peers: each returns per-request (ttft, tpot) and the wall time of the whole batch


def run_ours(
    engine: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[list[float], list[float], float]:
    from tokenops.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [f"bench-{t0}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    wall = max(last.values()) - t0
    ttft = [first[r] - t0 for r in ids]
    tpot = [(last[r] - first[r]) / (max_tokens - 1) for r in ids] if max_tokens > 1 else []
    return ttft, tpot, wall


def greedy_tokens(engine: Any, prompt: list[int], n: int) -> list[int]:
    """Our engine's first `n` greedy tokens for `prompt` (EOS ignored), to compare with llama.cpp's."""
    from tokenops.engine.sampling_params import SamplingParams

    rid = f"agree-{time.perf_counter()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens.extend(o.new_token_ids)
    return tokens


async def _http_level(
    url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[float], list[float], float]:
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> tuple[float, float, float]:
        first = last = None
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:  # a chunk per token, except bytes held back to complete a character
            last = time.perf_counter()
            if first is None:
                first = last
        return first - t0, (last - first) / max(max_tokens - 1, 1), last

    res = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    return [r[0] for r in res], [r[1] for r in res], max(r[2] for r in res) - t0


def run_http(
    url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[float], list[float], float]:
    """Our engine behind its HTTP server (a `tokenops engine` subprocess), streaming clients."""
    import asyncio

    return asyncio.run(_http_level(url, model, prompts, max_tokens))


class EngineProcess:
    """`tokenops engine OPTIONS` in a subprocess on a free port: the ours-http peer here, our server in
    serving_vs_vllm.py."""

    def __init__(self, options: list[str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("tokenops")
        self.cmd = [str(exe), "engine", "--port", str(self.port), "--log-level", "warning", *options]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tokenops engine exited before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("tokenops engine did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_transformers(
    model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int
) -> tuple[list[float], list[float], float]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            self.times.append(time.perf_counter())  # called once per step, after that step's forward
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=pad_id,
        )
    end = time.perf_counter()
    first = clock.times[0]
    ttft = [first - t0] * len(prompts)
    tpot = [(end - first) / (max_tokens - 1)] * len(prompts) if max_tokens > 1 else []
    return ttft, tpot, end - t0


# ---------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    from tokenops.cpu_info import cpuinfo_field

    cpu = cpuinfo_field("model name") or platform.processor()

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_isa": os.environ.get("TOKENOPS_KERNEL_ISA", "native"),
        "platform": platform.platform(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--cached-prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", default="float32", help="our engine's dtype")
    ap.add_argument(
        "--quantization",
        default="none",
        help="our engine's weight formats, comma-separated: none, int8, int4, int8_dynamic "
        "(one in-process peer each; ours-http uses the first)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="our engine's KV cache dtypes, comma-separated: auto, float32, bfloat16, float16, int8 "
        "(one in-process peer per weight format and KV dtype, named ours[-<weights>][-kv<dtype>]; "
        "ours-http uses the first)",
    )
    ap.add_argument(
        "--peers",
        default="ours,ours-http,transformers,llamacpp,vllm",
        help="ours (in-process LLMEngine), ours-http (tokenops engine subprocess, streaming "
        "HTTP clients), transformers, llamacpp, vllm (vLLM's OpenAI server from .venv-vllm)",
    )
    ap.add_argument(
        "--vllm-dtypes",
        default=None,
        help="dtypes of the vLLM peer, comma-separated (one server each, vllm-<dtype>); default: its "
        "fastest on this CPU, bfloat16 with AVX512-BF16/AMX, else float32",
    )
    ap.add_argument(
        "--vllm-optimization-levels",
        default="default",
        help="vLLM's --optimization-level per server, comma-separated (vllm-<dtype>-O<level>): 0 runs "
        "eager (starts in a minute), default is vLLM's own (torch.compile with inductor: minutes to start)",
    )
    ap.add_argument(
        "--vllm-bindings",
        default="cores",
        help="vLLM's thread binding per server, comma-separated: cores (OpenMP on the first --threads "
        "cores) or auto (vLLM's own default, which keeps a core for its front end: vllm-<dtype>-bindauto)",
    )
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--llamacpp-python",
        default=str(Path(__file__).resolve().parents[1] / ".venv-llamacpp" / "bin" / "python"),
        help="interpreter of a venv with llama-cpp-py-sync (`make bench-llamacpp-env`) or llama-cpp-python; "
        "llama.cpp is skipped when it has neither",
    )
    ap.add_argument(
        "--llamacpp-modes",
        default="batched,serial",
        help="batched (all requests of a level at once, continuous batching: the llamacpp peer), "
        "serial (one at a time: llamacpp-serial)",
    )
    ap.add_argument(
        "--transformers-dtypes",
        default="float32",
        help="dtypes of the transformers peer, comma-separated (float32 is `transformers`, others "
        "`transformers-<dtype>`): on CPUs with AMX or AVX512-BF16, bfloat16 is its fast configuration",
    )
    ap.add_argument("--agreement-tokens", type=int, default=16, help="greedy tokens compared with llama.cpp")
    ap.add_argument(
        "--lock",
        default=None,
        help="flock this file (e.g. /tmp/bench.lock) only for the timed runs: peers load, start (vLLM "
        "compiles) and warm up before it",
    )
    ap.add_argument("--json", default="benchmarks/results/engine_vs_peers.json")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from tokenops.bench.bench_lock import bench_lock

    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    peers = [p.strip() for p in args.peers.split(",")]
    from tokenops.engine.config import EngineConfig, resolve_dtype
    from tokenops.engine.llm_engine import LLMEngine
    from tokenops.engine.loader import load_model
    from tokenops.modelfiles.openmp import release_thread_pool

    quantizations = [q.strip() for q in args.quantization.split(",")]
    n_ctx = args.cached_prefix_tokens + 64 + args.prompt_tokens + args.output_tokens
    engines: dict[str, Any] = {}  # peer name -> LLMEngine, one per weight format
    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",")]
    kv_suffix = {
        "auto": "",
        "float32": "-kvfp32",
        "bfloat16": "-kvbf16",
        "float16": "-kvfp16",
        "int8": "-kvint8",
    }
    kv_storage: dict[str, str] = {}  # peer name -> the KV dtype its engine resolved
    for q, kv in [(q, kv) for q in quantizations for kv in kv_dtypes] if "ours" in peers else []:
        # a fresh load each: quantisation replaces the model's linears in place
        console.print(f"loading {args.model} for our engine ({args.dtype}, weights {q}, KV {kv}) ...")
        loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
        name = ("ours" if q == "none" else f"ours-{q}") + kv_suffix.get(kv, f"-kv{kv}")
        engines[name] = LLMEngine.from_loaded(
            loaded,
            EngineConfig(
                max_num_seqs=max(levels),
                max_num_batched_tokens=512,
                max_model_len=max(2048, n_ctx),
                quantization=None if q == "none" else q,
                kv_cache_dtype=kv,
            ),
        )
        kv_storage[name] = engines[name].load().kv_cache_dtype
    if not engines:
        loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
    tok = loaded.tokenizer
    gguf = loaded.path if str(loaded.path).endswith(".gguf") else None

    server = None
    if "ours-http" in peers:
        console.print("starting `tokenops engine` in a subprocess for the ours-http peer ...")
        server = EngineProcess(
            [
                *("--model", args.model, "--dtype", args.dtype),
                *("--max-num-seqs", str(max(levels)), "--max-model-len", str(max(2048, n_ctx))),
                *([] if quantizations[0] == "none" else ["--quantization", quantizations[0]]),
                *("--kv-cache-dtype", kv_dtypes[0]),
            ]
        )
    vllm_servers = _start_vllm(args, console, max(2048, n_ctx), max(levels)) if "vllm" in peers else {}

    hf_models: dict[str, Any] = {}  # peer name -> transformers model, one per dtype
    if "transformers" in peers:
        if gguf is None:
            console.print("[yellow]transformers peer needs a GGUF model; skipped")
        else:
            os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar
            import transformers

            transformers.utils.logging.disable_progress_bar()
            transformers.utils.logging.set_verbosity_error()
            for hf_dtype in (d.strip() for d in args.transformers_dtypes.split(",")):
                console.print(f"loading the same GGUF with transformers ({hf_dtype}) ...")
                name = "transformers" if hf_dtype == "float32" else f"transformers-{hf_dtype}"
                hf_models[name] = transformers.AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=resolve_dtype(hf_dtype)
                ).eval()
    llamacpp_modes: list[str] = []
    if "llamacpp" in peers and gguf is not None:
        binding = _llamacpp_binding(args.llamacpp_python)
        if binding is None and (binding := _llamacpp_binding(sys.executable)):
            args.llamacpp_python = sys.executable
        wanted = [m.strip() for m in args.llamacpp_modes.split(",")]
        # llama-cpp-python's API serves one request at a time: only the serial mode there
        llamacpp_modes = [m for m in wanted if binding == "llama_cpp_py_sync" or (binding and m == "serial")]
        if not llamacpp_modes:
            console.print(
                f"[yellow]llama.cpp skipped: no llama_cpp_py_sync / llama_cpp in {args.llamacpp_python} "
                "(make bench-llamacpp-env)"
            )
    have_llamacpp = bool(llamacpp_modes)

    # Both in-process peers compute on one worker thread, as the server's engine thread does: with
    # the process's main thread, PyTorch's OpenMP spin-waits made both peers many times slower
    # whenever the 2 cores were oversubscribed (measured 0.4 vs 5 tok/s at a load average of 12).
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-compute")

    def compute(fn: Any, *fn_args: Any) -> Any:
        return worker.submit(fn, *fn_args).result()

    # The models were loaded (and quantised) on this thread: give its idle OpenMP pool back, as
    # the engine server does when its engine thread starts, or the worker's pool is throttled
    # (modelfiles/openmp.py; a decode step 23.6 -> 17.3 ms).
    release_thread_pool()

    # warm up every peer on every level's shapes (fresh prompts, not timed): the first run of a
    # batch shape pays oneDNN's primitive creation (ours at 32: 267 against 321 tok/s after)
    warm = make_prompts(tok, "warm", 2, 16)
    warm_levels = {c: make_prompts(tok, f"warm{c}", c, args.prompt_tokens) for c in levels}
    for engine in engines.values():
        for prompts in warm_levels.values():
            compute(run_ours, engine, prompts, args.output_tokens)
    # HTTP peers: (name, base URL, model name), all driven by the same streaming clients
    http_peers: list[tuple[str, str, str]] = []
    if server is not None:
        server.wait_ready()
        http_peers.append(("ours-http", server.url, loaded.name))
    for name, vllm in vllm_servers.items():
        console.print(f"waiting for {name} (vLLM compiles the model at start-up) ...")
        vllm.wait_ready()
        http_peers.append((name, vllm.url, vllm.served_name))
    for _, url, model_name in http_peers:
        for prompts in warm_levels.values():
            run_http(url, model_name, prompts, args.output_tokens)
    for hf in hf_models.values():
        for prompts in warm_levels.values():
            compute(run_transformers, hf, prompts, args.output_tokens, tok.eos_token_ids[0])

    # greedy agreement with llama.cpp: one prompt, each of our engines' first tokens
    agree_prompt = make_prompts(tok, "agree", 1, args.prompt_tokens)[0]
    ours_tokens = {
        name: compute(greedy_tokens, e, agree_prompt, args.agreement_tokens) for name, e in engines.items()
    }
    llamacpp_info: dict[str, Any] = {}
    llamacpp_tokens: list[int] = []

    raw: dict[str, dict[str, list[dict[str, float]]]] = {}  # peer -> metric group -> repeats
    steps = (
        args.repeats * (len(levels) + 1) * (len(engines) + len(hf_models) + have_llamacpp + len(http_peers))
    )
    with (
        bench_lock(args.lock),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
    ):
        load_at_start = os.getloadavg()
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        task = progress.add_task("benchmark", total=steps)
        for rep in range(args.repeats):
            plan = {c: make_prompts(tok, f"r{rep}c{c}", c, args.prompt_tokens) for c in levels}
            prefix = make_prompts(tok, f"r{rep}prefix", 1, args.cached_prefix_tokens)[0]
            tails = [
                tok.encode(f" Question {k}: what comes next?", add_special_tokens=False) for k in range(3)
            ]
            cache_prompts = (
                make_prompts(tok, f"r{rep}cold", 1, args.cached_prefix_tokens)[0] + tails[0],  # cold
                prefix + tails[1],  # warms the prefix
                prefix + tails[2],  # served from the cache
            )
            # each level runs every peer back to back, so a pair's two runs are seconds apart rather
            # than minutes (this VM's pace drifts within minutes); odd repeats reverse the order
            runners: list[tuple[str, Any]] = [
                (name, lambda c, e=engine, p=plan: compute(run_ours, e, p[c], args.output_tokens))
                for name, engine in engines.items()
            ]
            runners += [
                (
                    http_name,
                    # prompts no server has seen (each server keeps its prefix cache across levels)
                    lambda c, u=url, m=model_name, h=http_name, r=rep: run_http(
                        u, m, make_prompts(tok, f"r{r}c{c}{h}", c, args.prompt_tokens), args.output_tokens
                    ),
                )
                for http_name, url, model_name in http_peers
            ]
            runners += [
                (
                    hf_name,
                    lambda c, h=hf, p=plan: compute(
                        run_transformers, h, p[c], args.output_tokens, tok.eos_token_ids[0]
                    ),
                )
                for hf_name, hf in hf_models.items()
            ]
            for c in levels:
                for name, run in runners if rep % 2 == 0 else runners[::-1]:
                    progress.update(task, description=f"repeat {rep + 1}: {name}, {c} concurrent")
                    ttft, tpot, wall = run(c)
                    raw.setdefault(name, {}).setdefault(f"c{c}", []).append(
                        summarise(ttft, tpot, c * args.output_tokens, wall)
                    )
                    progress.advance(task)
            for name, engine in engines.items():
                progress.update(task, description=f"repeat {rep + 1}: {name}, cached vs cold prefix")
                cold = compute(run_ours, engine, [cache_prompts[0]], 1)[0][0]
                compute(run_ours, engine, [cache_prompts[1]], 1)
                cached = compute(run_ours, engine, [cache_prompts[2]], 1)[0][0]
                raw[name].setdefault("cache", []).append({"cold_ttft_s": cold, "cached_ttft_s": cached})
                progress.advance(task)
            for http_name, url, model_name in http_peers:
                progress.update(task, description=f"repeat {rep + 1}: {http_name}, cached vs cold prefix")
                pre = make_prompts(tok, f"r{rep}{http_name}-prefix", 1, args.cached_prefix_tokens)[0]
                cold = run_http(
                    url,
                    model_name,
                    [
                        make_prompts(tok, f"r{rep}{http_name}-cold", 1, args.cached_prefix_tokens)[0]
                        + tails[0]
                    ],
                    1,
                )
                run_http(url, model_name, [pre + tails[1]], 1)
                cached = run_http(url, model_name, [pre + tails[2]], 1)
                raw[http_name].setdefault("cache", []).append(
                    {"cold_ttft_s": cold[0][0], "cached_ttft_s": cached[0][0]}
                )
                progress.advance(task)
            for hf_name, hf in hf_models.items():
                pad = tok.eos_token_ids[0]
                progress.update(task, description=f"repeat {rep + 1}: {hf_name}, cold prefix")
                cold = compute(run_transformers, hf, [cache_prompts[0]], 1, pad)[0][0]
                # transformers has no cache across generate calls: the "cached" prompt is cold too
                cached = compute(run_transformers, hf, [cache_prompts[2]], 1, pad)[0][0]
                raw[hf_name].setdefault("cache", []).append({"cold_ttft_s": cold, "cached_ttft_s": cached})
                progress.advance(task)
            if have_llamacpp:
                progress.update(task, description=f"repeat {rep + 1}: llama.cpp (subprocess)")
                res = _run_llamacpp(args, gguf, llamacpp_modes, plan, warm[0], cache_prompts, agree_prompt)
                llamacpp_info, llamacpp_tokens = res["info"], res["agreement_tokens"]
                for mode in llamacpp_modes:
                    name = "llamacpp" if mode == "batched" else "llamacpp-serial"
                    for c in levels:
                        r = res["modes"][mode][str(c)]
                        raw.setdefault(name, {}).setdefault(f"c{c}", []).append(
                            summarise(r["ttft"], r["tpot"], c * args.output_tokens, r["wall"])
                        )
                # the prompt cache belongs to the process: reported once, on the first mode's peer
                first = "llamacpp" if llamacpp_modes[0] == "batched" else "llamacpp-serial"
                raw[first].setdefault("cache", []).append(
                    {"cold_ttft_s": res["cache"]["cold_s"], "cached_ttft_s": res["cache"]["cached_s"]}
                )
                progress.advance(task, len(levels) + 1)
        load_at_end = os.getloadavg()

    if server is not None:
        server.stop()
    for vllm in vllm_servers.values():
        vllm.stop()
    medians = {
        peer: {
            group: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for group, runs in groups.items()
        }
        for peer, groups in raw.items()
    }
    ratios: dict[str, Any] = {}
    for mine in [p for p in medians if p.startswith("ours")]:
        for peer in [p for p in medians if not p.startswith("ours")]:
            ratios[f"{mine}_vs_{peer}"] = {
                f"c{c}_output_tokens_per_s": medians[mine][f"c{c}"]["output_tokens_per_s"]
                / medians[peer][f"c{c}"]["output_tokens_per_s"]
                for c in levels
            }
            for c in levels:
                ratios[f"{mine}_vs_{peer}"][f"c{c}_output_tokens_per_s_paired"] = paired_ratios(
                    raw[mine][f"c{c}"], raw[peer][f"c{c}"], "output_tokens_per_s"
                )
            if 1 in levels:
                ratios[f"{mine}_vs_{peer}"]["c1_tpot_ratio"] = (
                    medians[mine]["c1"]["tpot_p50_s"] / medians[peer]["c1"]["tpot_p50_s"]
                )
        cache = medians[mine]["cache"]
        ratios[f"{mine}_cold_over_cached_ttft"] = cache["cold_ttft_s"] / cache["cached_ttft_s"]
    agreement = {
        name: {
            "tokens_compared": min(len(tokens), len(llamacpp_tokens)),
            "leading_tokens_equal": _leading_equal(tokens, llamacpp_tokens),
            "positions_equal": sum(a == b for a, b in zip(tokens, llamacpp_tokens, strict=False)),
            "ours": tokens,
            "llamacpp": llamacpp_tokens,
        }
        for name, tokens in ours_tokens.items()
        if llamacpp_tokens
    }
    result = {
        "date": started,
        "timed_until": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": load_at_end,
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "model": args.model,
            "gguf": str(gguf) if gguf else None,
            "our_dtype": args.dtype,
            "our_quantization": quantizations,
            "our_kv_cache_dtype": kv_dtypes,
            "our_kv_cache_storage": kv_storage,
            "threads": args.threads,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "cached_prefix_tokens": args.cached_prefix_tokens,
            "concurrency": levels,
            "repeats": args.repeats,
            "ours": "in-process LLMEngine (no HTTP)",
            "ours-http": "tokenops engine subprocess, streaming /v1/completions clients (openai SDK)",
            "transformers": f"generate(), one batch, dtypes {args.transformers_dtypes}",
            "llamacpp": "llama.cpp via benchmarks/llamacpp_worker.py: batched = one multi-sequence context, "
            "continuous batching through llama_decode; serial = one request at a time"
            if have_llamacpp
            else "not run",
            "llamacpp_modes": llamacpp_modes,
            "vllm": {
                name: {"command": " ".join(v.command()), "env": {k: v.env()[k] for k in VLLM_ENV_KEYS}}
                for name, v in vllm_servers.items()
            },
        },
        "llamacpp": llamacpp_info,
        "medians": medians,
        "ratios": ratios,
        "greedy_agreement_with_llamacpp": agreement,
        "runs": raw,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _print_table(console, Table, medians, levels)
    console.print(f"ratios: {json.dumps(ratios, indent=1)}")
    for name, a in agreement.items():
        console.print(
            f"greedy agreement {name} vs llama.cpp: first {a['leading_tokens_equal']} of "
            f"{a['tokens_compared']} tokens equal ({a['positions_equal']} positions equal)"
        )
    console.print(f"written to {out}")


VLLM_ENV_KEYS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")


def _start_vllm(
    args: argparse.Namespace, console: Any, max_model_len: int, max_num_seqs: int
) -> dict[str, Any]:
    """One vLLM server per `--vllm-dtypes`, `--vllm-optimization-levels` and `--vllm-bindings` entry,
    started now (they compile while the others load and warm up)."""
    from tokenops.bench.vllm_process import VLLMServer, best_cpu_dtype, vllm_missing

    reason = vllm_missing()
    if reason:
        console.print(f"[yellow]vLLM skipped: {reason}")
        return {}
    servers = {}
    dtypes = [d.strip() for d in (args.vllm_dtypes or best_cpu_dtype()).split(",")]
    levels = [o.strip() for o in args.vllm_optimization_levels.split(",")]
    bindings = [b.strip() for b in args.vllm_bindings.split(",")]
    for dtype, level, binding in [(d, o, b) for d in dtypes for o in levels for b in bindings]:
        if binding not in ("cores", "auto"):
            raise SystemExit(f"--vllm-bindings: {binding!r} is neither cores nor auto")
        console.print(f"starting vLLM's OpenAI server ({dtype}, -O {level}, binding {binding}) ...")
        name = f"vllm-{dtype}" + ("" if level == "default" else f"-O{level}")
        name += "" if binding == "cores" else "-bindauto"
        servers[name] = VLLMServer(
            dtype=dtype,
            threads=args.threads,
            cores=None if binding == "cores" else "auto",
            kv_cache_gib=args.vllm_kv_cache_gib,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            extra_args=[] if level == "default" else ["--optimization-level", level],
        ).start()
    return servers


def _llamacpp_binding(python: str) -> str | None:
    """The llama.cpp binding `python` has ('llama_cpp_py_sync' or 'llama_cpp'), or None."""
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, str(WORKER), "--binding"], capture_output=True, text=True)
    return (probe.stdout.strip() or None) if probe.returncode == 0 else None


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _run_llamacpp(
    args: argparse.Namespace,
    gguf: Path,
    modes: list[str],
    plan: dict[int, list[list[int]]],
    warm: list[int],
    cache_prompts: tuple[list[int], ...],
    agree_prompt: list[int],
) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spec = {
            "gguf": str(gguf),
            "threads": args.threads,
            "n_batch": 512,  # our engine's max_num_batched_tokens
            "max_tokens": args.output_tokens,
            "modes": modes,
            "levels": {str(c): p for c, p in plan.items()},
            "warmup": warm,
            "cache": list(cache_prompts),
            "agreement_prompt": agree_prompt,
            "agreement_tokens": args.agreement_tokens,
            "out": f"{d}/out.json",
        }
        Path(f"{d}/spec.json").write_text(json.dumps(spec))
        # llama.cpp logs its model load to stderr: kept out of the table, shown if the worker fails
        proc = subprocess.run(
            [args.llamacpp_python, str(WORKER), f"{d}/spec.json"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(spec["out"]).read_text())


def _print_table(console: Any, table_cls: Any, medians: dict[str, Any], levels: list[int]) -> None:
    table = table_cls(title="engine vs peers (medians)")
    for col in ("peer", "concurrency", "out tok/s", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"):
        table.add_column(col, justify="right")
    for peer, groups in medians.items():
        for c in levels:
            m = groups[f"c{c}"]
            table.add_row(
                peer,
                str(c),
                f"{m['output_tokens_per_s']:.1f}",
                f"{m['ttft_p50_s'] * 1000:.0f} ms",
                f"{m['ttft_p90_s'] * 1000:.0f} ms",
                f"{m['tpot_p50_s'] * 1000:.1f} ms",
                f"{m['tpot_p90_s'] * 1000:.1f} ms",
            )
        cache = groups.get("cache")
        if cache is None:
            continue
        table.add_row(
            peer,
            "cold / cached",
            "",
            f"{cache['cold_ttft_s'] * 1000:.0f} ms",
            f"{cache['cached_ttft_s'] * 1000:.0f} ms",
            "",
            "",
        )
    console.print(table)


if __name__ == "__main__":
    main()
