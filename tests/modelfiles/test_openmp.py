"""The OpenMP pool release (modelfiles/openmp.py): a thread's idle workers really go, and the engine's
start gives back the loading thread's pool so that the engine thread's is the only one.

Each case runs in a fresh interpreter: OpenMP pools and thread counts are process-wide state that
the rest of the suite (and pytest's own threads) would blur. A pool shows as OS threads in
/proc/self/task; with 2 intra-op threads a pool holds one worker besides its owner.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")

PRELUDE = """
import os, threading, torch
torch.set_num_threads(2)

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(n):
    # a joined thread's OS thread exits a moment after join() returns
    import time
    for _ in range(100):
        if threads() == n:
            return True
        time.sleep(0.01)
    return False

def parallel_work():
    # big enough that ATen splits it across the intra-op threads (an OpenMP parallel region)
    x = torch.rand(1 << 23)
    (x * 2.0).sum().item()
"""


def run(body: str) -> list[str]:
    code = PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_release_gives_back_the_calling_threads_workers():
    before, with_pool, released, after, again = run("""
        from tokenops.modelfiles.openmp import openmp_runtime, release_thread_pool
        before = threads()
        parallel_work()
        with_pool = threads()
        released = release_thread_pool()
        after = threads()
        parallel_work()  # the runtime builds a new pool on demand
        print(before, with_pool, released, after, threads())
    """)
    assert int(with_pool) == int(before) + 1, "a 2-thread parallel region should have left one worker"
    assert released == "True"
    assert int(after) == int(before)
    assert int(again) == int(before) + 1


def test_release_on_a_thread_without_a_pool_is_harmless():
    (released, count_same) = run("""
        from tokenops.modelfiles.openmp import release_thread_pool
        parallel_work()
        n = threads()
        result = []
        t = threading.Thread(target=lambda: result.append(release_thread_pool()))
        t.start(); t.join()
        print(result[0], settled(n))
    """)
    assert released == "True" and count_same == "True", (
        "the main thread's pool must survive another thread's release"
    )


def test_engine_start_leaves_only_the_engine_threads_pool():
    """The model is built and used on the main thread (whose pool stays behind); once the engine
    starts, the process holds the engine thread and no idle worker of the main thread's."""
    before_start, after_start = run("""
        import asyncio
        from tokenops.engine.async_engine import AsyncEngine
        from tokenops.engine.config import EngineConfig
        from tokenops.engine.llm_engine import LLMEngine
        from tokenops.engine.models import ModelConfig, build_model

        config = ModelConfig.from_hf_config({
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        })
        engine = LLMEngine(
            build_model(config, dtype=torch.float32), EngineConfig(num_kv_blocks=16, max_model_len=64)
        )
        parallel_work()  # the loading thread's pool, as a real model load leaves it

        async def main():
            n = threads()
            async_engine = AsyncEngine(engine)
            async_engine.start()
            await asyncio.sleep(0.2)
            print(n, threads())
            async_engine.shutdown()

        asyncio.run(main())
    """)
    # + the engine thread, - the main thread's idle worker
    assert int(after_start) == int(before_start)


def test_the_embedder_leaves_no_pool_on_its_worker_thread():
    """The semantic cache embeds on asyncio's worker threads: beside an engine thread, each would
    otherwise keep a pool."""
    (settled,) = run("""
        from concurrent.futures import ThreadPoolExecutor
        from tokenops.embeddings import shared_embedder
        from tokenops.modelfiles.openmp import claim_for_engine_thread
        claim_for_engine_thread()  # as AsyncEngine.start does: an engine thread computes here
        embedder = shared_embedder()
        texts = ["a sentence to embed, long enough to be split up"] * 16
        embedder.embed(texts)  # loads it, and starts the tokenizer's own (non-OpenMP) threads
        worker = ThreadPoolExecutor(1)
        worker.submit(lambda: None).result()  # the worker thread exists before counting
        n = threads()
        worker.submit(embedder.embed, texts).result()
        print(settled(n))
    """)
    assert settled == "True"


def test_without_an_engine_thread_the_embedder_keeps_its_pool():
    """A gateway with no embedded engine: nothing to protect, so no pool rebuilt on every call."""
    (settled,) = run("""
        from concurrent.futures import ThreadPoolExecutor
        from tokenops.embeddings import shared_embedder
        embedder = shared_embedder()
        texts = ["a sentence to embed, long enough to be split up"] * 16
        embedder.embed(texts)
        worker = ThreadPoolExecutor(1)
        worker.submit(lambda: None).result()
        n = threads()
        worker.submit(embedder.embed, texts).result()
        print(settled(n + 1))
    """)
    assert settled == "True"
