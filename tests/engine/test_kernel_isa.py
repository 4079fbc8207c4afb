"""The native kernels' build target (`TOKENOPS_KERNEL_ISA`): the flags each target builds with, and the
AVX2 build on a CPU with AVX-512, run against the same torch references as the native build (the
kernel test modules again, in a subprocess that builds and loads the AVX2 library)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenops.engine import kernels

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/engine/test_native_blocks.py",
    "tests/engine/test_native_gemv.py",
    "tests/engine/test_native_kernels.py",
    "tests/engine/test_paged_decode_kernel.py",
    "tests/engine/test_paged_prefill_kernel.py",
]


def test_targets_select_their_march(monkeypatch):
    for isa, march in [
        ("native", "-march=native"),
        ("avx2", "-march=x86-64-v3"),
        ("avx512", "-march=x86-64-v4"),
    ]:
        monkeypatch.setenv("TOKENOPS_KERNEL_ISA", isa)
        assert kernels.kernel_isa() == isa
        assert march in kernels.cflags()
    monkeypatch.delenv("TOKENOPS_KERNEL_ISA")
    assert kernels.kernel_isa() == "native"


def test_unknown_target_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENOPS_KERNEL_ISA", "avx10")
    with pytest.raises(ValueError, match="TOKENOPS_KERNEL_ISA='avx10': use one of native, avx2, avx512"):
        kernels.kernel_isa()


def test_native_build_reports_the_paths_it_compiled():
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"native kernels unavailable: {kernels.build_error()}")
    want = "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"
    if os.environ.get("TOKENOPS_KERNEL_ISA") == "avx2":
        want = "avx2"
    assert ops.compiled_isa() == want


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512" or os.environ.get("TOKENOPS_KERNEL_ISA") == "avx2",
    reason="without AVX-512 the native build already is the AVX2 build the kernel tests run",
)
def test_avx2_build_passes_the_kernel_tests():
    """The AVX2 code paths (8-lane gemv blocks, attention scores / exp / accumulation) are what this
    build compiles and runs; every kernel test module checks them against torch."""
    env = {**os.environ, "TOKENOPS_KERNEL_ISA": "avx2", "PYTHONPATH": str(ROOT / "src")}
    check = subprocess.run(
        [sys.executable, "-c", "from tokenops.engine import kernels; print(kernels.ops().compiled_isa())"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.strip() == "avx2"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:]
