"""vLLM's OpenAI server from its own venv (`make vllm-env`), as a subprocess on a loopback port.

The vLLM integration tests and the vLLM peer of benchmarks/engine_vs_peers.py start it the same way.
vLLM never enters the project's venv: it pins its own torch and pulls packages we do not want, so it
lives in `.venv-vllm` and is reached only over HTTP (and ZeroMQ for its KV events). Its CPU build binds
its OpenMP threads to the cores in VLLM_CPU_OMP_THREADS_BIND and sets OMP_NUM_THREADS from that list
(its default, `auto`, keeps one core for its scheduler: one compute thread on 2 cores);
VLLM_CPU_KVCACHE_SPACE (GiB) sizes its KV cache, which it would otherwise take generously from a
machine other processes share. docs/backends.md says which of its CPU settings are used and why.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenops.bench.ports import free_port
from tokenops.cpu_info import cpu_flags

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_DIR = ROOT / ".cache" / "vllm-models" / "smollm2-135m-instruct"


def best_cpu_dtype(flags: frozenset[str] | None = None) -> str:
    """vLLM's fastest dtype on this CPU: bfloat16 where oneDNN computes it natively (AVX512-BF16 or
    AMX); elsewhere its bf16 GEMMs fall back from oneDNN to a slow reference path, and float32 wins."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def vllm_missing(python: Path = VLLM_PYTHON, model_dir: Path = VLLM_MODEL_DIR) -> str | None:
    """Why vLLM cannot be started here (None when it can)."""
    if not python.exists():
        return f"no vLLM venv at {python.parent.parent} (run `make vllm-env`)"
    if not (model_dir / "config.json").is_file():
        return f"no HF folder of the bundled model at {model_dir} (run `make vllm-env`)"
    return None


@dataclass
class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` process. `start()`, `wait_ready()`, `stop()`."""

    served_name: str = "smollm2-135m-instruct"
    dtype: str = field(default_factory=best_cpu_dtype)
    threads: int = os.cpu_count() or 1
    # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"; default: the first `threads` cores. "auto" is vLLM's own
    # default, which keeps a core for its front end (one OpenMP thread on a 2-core machine)
    cores: str | None = None
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    max_model_len: int = 2048
    max_num_seqs: int = 32
    block_size: int | None = None  # vLLM's default when None
    kv_events: bool = False  # publish KV events over ZeroMQ (PUB + replay ROUTER on free ports)
    extra_args: list[str] = field(default_factory=list)
    python: Path = VLLM_PYTHON
    model_dir: Path = VLLM_MODEL_DIR
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # where we connect; vLLM binds its PUB socket only for a wildcard address (a host address makes
        # it connect out instead), its replay ROUTER on whatever it is given
        self._events_port = free_port()
        self.events_endpoint = f"tcp://127.0.0.1:{self._events_port}" if self.kv_events else None
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if self.kv_events else None
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # cached_tokens in usage, which the gateway meters
            "--disable-uvicorn-access-log",
        ]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.kv_events:
            config = (
                '{"enable_kv_cache_events": true, "publisher": "zmq", '
                f'"endpoint": "tcp://*:{self._events_port}", "replay_endpoint": "{self.replay_endpoint}"}}'
            )
            cmd += ["--kv-events-config", config]
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS=str(self.threads),
            VLLM_CPU_OMP_THREADS_BIND=self.cores or (f"0-{self.threads - 1}" if self.threads > 1 else "0"),
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        env.pop("PYTHONPATH", None)  # our sources must not shadow vLLM's packages
        if self.cores == "auto":  # vLLM sizes its OpenMP pool from the binding it chooses
            env.pop("OMP_NUM_THREADS", None)
        return env

    def start(self) -> VLLMServer:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = 900) -> None:
        """Until `/v1/models` answers (start-up compiles the model: minutes on a small CPU)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:] if self.log_path and self.log_path.exists() else ""
                raise RuntimeError(f"vLLM exited before it was ready\n{tail}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not become ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # vLLM's API server stops its engine core process on SIGTERM
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
