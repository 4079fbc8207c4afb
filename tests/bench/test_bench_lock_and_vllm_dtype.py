"""The benchmark lock excludes a second holder until the first lets go, and vLLM's dtype follows the
CPU's bf16 support."""

from __future__ import annotations

import fcntl

import pytest

from tokenops.bench.bench_lock import bench_lock
from tokenops.bench.vllm_process import best_cpu_dtype


def _free(path: str) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_the_lock_is_held_only_inside_the_block(tmp_path) -> None:
    path = str(tmp_path / "bench.lock")
    assert _free(path)
    with bench_lock(path):
        assert not _free(path)  # what `flock /tmp/bench.lock cmd` of another run would wait on
    assert _free(path)
    with bench_lock(None):  # no lock asked for: nothing taken
        assert _free(path)


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ({"avx2", "fma", "f16c"}, "float32"),  # the EPYC AVX2 kind: bf16 is emulated
        ({"avx2", "avx512f", "avx512bw"}, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),
    ],
)
def test_vllm_runs_bfloat16_only_where_the_cpu_computes_it(flags: set[str], dtype: str) -> None:
    assert best_cpu_dtype(frozenset(flags)) == dtype
