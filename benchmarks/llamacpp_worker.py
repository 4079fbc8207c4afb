"""llama.cpp side of benchmarks/engine_vs_peers.py, run by that script in a separate venv.

    python benchmarks/llamacpp_worker.py SPEC.json     (the spec names the GGUF, prompts and an output path)

It never imports tokenops: it runs under the interpreter of a venv that has a llama.cpp binding
(`make bench-llamacpp-env` builds one with llama-cpp-py-sync), and takes whichever binding is there:

- llama-cpp-py-sync (`llama_cpp_py_sync`): its CFFI bindings of llama.cpp's C API drive
  `llama_decode` directly, as llama-server's parallel slots do: one context whose KV cache holds
  up to `n_seq_max` sequences, and every step one `llama_batch` with the next token of each running
  sequence plus as many prompt tokens of waiting ones as fit in `n_batch` (chunked prefill, the
  same 512-token budget our engine gets), greedy argmax over each sequence's last logits.
  "batched" lets every request of a level run at once (continuous batching, like our engine);
  "serial" admits one at a time (what a request-at-a-time loop, e.g. llama-cpp-python's
  `Llama.create_completion`, does). Cached-prefix TTFT keeps sequence 0's KV between prompts and
  decodes only what follows the common prefix, as llama-server's prompt cache does.
- llama-cpp-python (`llama_cpp`): `Llama.create_completion`, one request after the other
  ("serial" only: its Python API has no batching).

Greedy, EOS never ends a request, fixed output length. TTFT of a request is measured from the
level's start (all requests arrive then) to its first generated token, as our driver does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class BatchedLlama:
    """llama.cpp's C API through llama-cpp-py-sync: one model, one multi-sequence context."""

    def __init__(self, gguf: str, threads: int, n_seq_max: int, n_ctx_seq: int, n_batch: int) -> None:
        import numpy as np
        from llama_cpp_py_sync import __llama_cpp_commit__, __llama_cpp_tag__
        from llama_cpp_py_sync._cffi_bindings import ffi, get_lib

        self.np, self.ffi, self.lib = np, ffi, get_lib()
        lib = self.lib
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(gguf.encode(), mparams)
        if self.model == ffi.NULL:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lib.llama_context_default_params()
        # one KV stream per sequence (llama.cpp's default, non-unified): attention of a sequence
        # spans only its own cells, so n_ctx is n_seq_max times the per-sequence length
        cparams.n_seq_max = n_seq_max
        cparams.n_ctx = n_seq_max * n_ctx_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if self.ctx == ffi.NULL:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.cached: list[int] = []  # tokens whose KV sequence 0 holds, for prefix reuse
        desc = ffi.new("char[256]")
        lib.llama_model_desc(self.model, desc, 256)
        self.info = {
            "binding": "llama-cpp-py-sync",
            "llama_cpp_tag": __llama_cpp_tag__,
            "llama_cpp_commit": __llama_cpp_commit__,
            "llama_version": ffi.string(lib.llama_version()).decode(),
            "model": ffi.string(desc).decode(),
            "system_info": ffi.string(lib.llama_print_system_info()).decode().strip(),
            "n_ctx": lib.llama_n_ctx(self.ctx),
            "n_seq_max": lib.llama_n_seq_max(self.ctx),
            "n_batch": n_batch,
            "threads": threads,
        }

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, False)  # metadata only: zeroing the buffers is not needed
        self.cached = []

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> Any:
        """entries: (token, position, seq_id, wants_logits); returns the argmax of each wanted row."""
        b = self.batch
        for i, (token, pos, seq, out) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(e[3] for e in entries)
        logits = self.np.frombuffer(
            self.ffi.buffer(self.lib.llama_get_logits(self.ctx), 4 * n_out * self.n_vocab),
            dtype=self.np.float32,
        )
        return logits.reshape(n_out, self.n_vocab).argmax(axis=1).tolist()

    def run(self, prompts: list[list[int]], max_tokens: int, max_running: int) -> dict[str, Any]:
        """Serves `prompts`, all arriving at once, at most `max_running` at a time; per-request timings."""
        self.clear()
        t0 = time.perf_counter()
        n = len(prompts)
        free_seqs = list(range(min(max_running, self.n_seq_max)))[::-1]
        waiting = list(range(n))
        seq: dict[int, int] = {}  # request -> its sequence id
        fed = [0] * n  # prompt tokens already decoded
        generated: list[list[int]] = [[] for _ in range(n)]
        first = [0.0] * n
        last = [0.0] * n
        running: list[int] = []
        while waiting or running:
            while waiting and free_seqs:
                r = waiting.pop(0)
                seq[r] = free_seqs.pop()
                running.append(r)
            entries, owners = [], []
            for r in running:  # one decode token per sequence past its prompt
                if fed[r] == len(prompts[r]):
                    entries.append((generated[r][-1], len(prompts[r]) + len(generated[r]) - 1, seq[r], True))
                    owners.append(r)
            for r in running:  # then prompt chunks in the remaining budget
                take = min(len(prompts[r]) - fed[r], self.n_batch - len(entries))
                if take <= 0:
                    continue
                for k in range(fed[r], fed[r] + take):
                    done = k == len(prompts[r]) - 1
                    entries.append((prompts[r][k], k, seq[r], done))
                    if done:
                        owners.append(r)
                fed[r] += take
            # logits rows come in batch order: decode rows first, then the finished prompts'
            nxt = self._decode(entries)
            now = time.perf_counter()
            for r, token in zip(owners, nxt, strict=True):
                if not generated[r]:
                    first[r] = now
                generated[r].append(token)
                last[r] = now
            for r in [r for r in running if len(generated[r]) >= max_tokens]:
                running.remove(r)
                self.lib.llama_memory_seq_rm(self.mem, seq[r], -1, -1)
                free_seqs.append(seq.pop(r))
        return {
            "ttft": [f - t0 for f in first],
            "tpot": [(la - f) / max(max_tokens - 1, 1) for f, la in zip(first, last, strict=True)],
            "wall": max(last) - t0,
            "tokens": generated,
        }

    def prefix_cached_ttft(self, prompt: list[int]) -> float:
        """TTFT of one prompt on sequence 0, reusing the KV of the longest prefix it shares with the
        previous prompt there (llama-server's prompt cache), then keeping it for the next one."""
        t0 = time.perf_counter()
        common = 0  # the last prompt token is always decoded: its logits give the first token
        for a, b in zip(self.cached, prompt[:-1], strict=False):
            if a != b:
                break
            common += 1
        self.lib.llama_memory_seq_rm(self.mem, 0, common, -1)
        for start in range(common, len(prompt), self.n_batch):
            chunk = prompt[start : start + self.n_batch]
            self._decode([(t, start + i, 0, start + i == len(prompt) - 1) for i, t in enumerate(chunk)])
        ttft = time.perf_counter() - t0
        self.cached = list(prompt)
        return ttft


def run_py_sync(spec: dict[str, Any]) -> dict[str, Any]:
    levels = {int(c): p for c, p in spec["levels"].items()}
    longest = max(len(p) for p in spec["cache"]) + 1
    per_seq = max(longest, max(len(p) for ps in levels.values() for p in ps) + spec["max_tokens"])
    llm = BatchedLlama(spec["gguf"], spec["threads"], max(levels), -(-per_seq // 256) * 256, spec["n_batch"])
    out: dict[str, Any] = {"info": llm.info, "modes": {}, "cache": {}}
    llm.run([spec["warmup"]] * 2, 4, 2)
    out["agreement_tokens"] = llm.run([spec["agreement_prompt"]], spec["agreement_tokens"], 1)["tokens"][0]
    for mode in spec["modes"]:
        out["modes"][mode] = {}
        for c, prompts in levels.items():
            res = llm.run(prompts, spec["max_tokens"], c if mode == "batched" else 1)
            del res["tokens"]
            out["modes"][mode][str(c)] = res
    cold, warm_up, cached = spec["cache"]
    llm.clear()
    out["cache"]["cold_s"] = llm.prefix_cached_ttft(cold)
    llm.prefix_cached_ttft(warm_up)
    out["cache"]["cached_s"] = llm.prefix_cached_ttft(cached)
    return out


def run_llama_cpp_python(spec: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python's high-level API: sequential completions ("serial" only)."""
    import llama_cpp

    levels = {int(c): p for c, p in spec["levels"].items()}
    llm = llama_cpp.Llama(
        model_path=spec["gguf"],
        n_ctx=max(2048, max(len(p) for p in spec["cache"]) + 64),
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_batch=spec["n_batch"],
        verbose=False,
    )
    no_eos = {llm.token_eos(): -1e9}  # the only way to keep its completion going past EOS

    def one(prompt: list[int], max_tokens: int, t0: float) -> tuple[float, float, list[int]]:
        first, tokens = None, []
        for chunk in llm.create_completion(
            prompt=prompt, max_tokens=max_tokens, temperature=0.0, top_k=1, logit_bias=no_eos, stream=True
        ):
            tokens.append(chunk)
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return first - t0, (end - first) / max(len(tokens) - 1, 1), tokens

    out: dict[str, Any] = {
        "info": {
            "binding": "llama-cpp-python",
            "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "threads": spec["threads"],
        },
        "modes": {"serial": {}},
        "cache": {},
        "agreement_tokens": [],  # its streamed chunks are text, not token ids
    }
    one(spec["warmup"], 4, time.perf_counter())
    for c, prompts in levels.items():
        ttft, tpot = [], []
        t0 = time.perf_counter()
        for p in prompts:  # all arrive at t0; served one after the other
            a, b, _ = one(p, spec["max_tokens"], t0)
            ttft.append(a)
            tpot.append(b)
        out["modes"]["serial"][str(c)] = {"ttft": ttft, "tpot": tpot, "wall": time.perf_counter() - t0}
    cold, warm_up, cached = spec["cache"]
    out["cache"]["cold_s"] = one(cold, 1, time.perf_counter())[0]
    one(warm_up, 1, time.perf_counter())
    # create_completion reuses the KV of the prefix it shares with the previous prompt
    out["cache"]["cached_s"] = one(cached, 1, time.perf_counter())[0]
    return out


def binding() -> str | None:
    """The llama.cpp binding this interpreter has: 'llama_cpp_py_sync', 'llama_cpp' or None."""
    import importlib.util

    for name in ("llama_cpp_py_sync", "llama_cpp"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def main() -> None:
    if sys.argv[1:] == ["--binding"]:
        print(binding() or "")
        return
    spec = json.loads(Path(sys.argv[1]).read_text())
    which = binding()
    if which is None:
        sys.exit("no llama.cpp binding (llama_cpp_py_sync or llama_cpp) in this interpreter")
    out = run_py_sync(spec) if which == "llama_cpp_py_sync" else run_llama_cpp_python(spec)
    Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
