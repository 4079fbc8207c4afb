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

from tokenops import cpu_info
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
        ("avx2_vnni", "-march=x86-64-v3"),
        ("avx512", "-march=x86-64-v4"),
        ("portable", "-march=x86-64"),
    ]:
        monkeypatch.setenv("TOKENOPS_KERNEL_ISA", isa)
        assert kernels.kernel_isa() == isa
        assert march in kernels.cflags()
        assert ("-mavxvnni" in kernels.cflags()) == (isa == "avx2_vnni")
    monkeypatch.delenv("TOKENOPS_KERNEL_ISA")
    assert kernels.kernel_isa() == "native"


def test_unknown_target_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENOPS_KERNEL_ISA", "avx10")
    with pytest.raises(
        ValueError, match="TOKENOPS_KERNEL_ISA='avx10': use one of native, avx2, avx2_vnni, avx512, portable"
    ):
        kernels.kernel_isa()


def test_native_build_reports_the_paths_it_compiled():
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"native kernels unavailable: {kernels.build_error()}")
    flags = cpu_info.cpu_flags()
    isa = kernels.kernel_isa()
    want = "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"
    # native: vpdpbusd wherever the CPU has a 256-bit form of it
    vnni = {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags
    dot = "vnni" if vnni else "maddubs"
    if isa in ("avx2", "avx2_vnni", "portable"):
        want = "avx2" if isa.startswith("avx2") else isa
        dot = {"avx2": "maddubs", "avx2_vnni": "vnni", "portable": "scalar"}[isa]
    elif isa == "avx512":
        want, dot = "avx512", "maddubs"  # x86-64-v4 has no VNNI
    assert ops.compiled_isa() == want
    assert ops.compiled_int8_dot() == dot


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


BLOCKS_BUILT_FOR = """
import sys, torch
from torch.utils import cpp_extension
out, name, march = sys.argv[1], sys.argv[2], sys.argv[3].split()
cpp_extension.load(name=name, sources=sys.argv[4:], build_directory=out,
                   extra_cflags=["-O2", *march, "-fopenmp", "-std=c++17"], extra_ldflags=["-fopenmp"],
                   is_python_module=False)
inputs = torch.load(out + "/inputs.pt")
ops = torch.ops.tokenops
torch.save({"q8": ops.linear_q8(*inputs["q8"]), "q4": ops.linear_q4(*inputs["q4"]),
            "q4_odd": ops.linear_q4(*inputs["q4_odd"]), "q8_odd": ops.linear_q8(*inputs["q8_odd"]),
            "deq": ops.dequantize_q4_bf16(*inputs["deq"]), "dot": ops.compiled_int8_dot()},
           out + "/outputs.pt")
"""

# (build, -march and flags, the integer dot product it compiles, the CPU flags it needs to run)
BLOCK_BUILDS = [
    ("portable", "-march=x86-64", "scalar", set()),
    ("avx2", "-march=x86-64-v3", "maddubs", {"avx2", "fma", "f16c"}),
    ("avx_vnni", "-march=x86-64-v3 -mavxvnni", "vnni", {"avx2", "fma", "f16c", "avx_vnni"}),
    (
        "avx512_vnni",
        "-march=x86-64-v4 -mavx512vnni",
        "vnni",
        {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    ),
]


@pytest.mark.parametrize("build, march, dot, needs", BLOCK_BUILDS, ids=[b[0] for b in BLOCK_BUILDS])
def test_every_build_of_the_block_kernels_agrees(native, tmp_path, build, march, dot, needs):
    """linear_blocks.cpp built for each target its macros distinguish (the one-lane fallback, AVX2's
    vpmaddubsw, and vpdpbusd in its VEX and EVEX forms) against this build on the same inputs: the same
    outputs to the bit (the same integer sums and float32 FMAs in the same order; AVX-512's pairs of
    tiles and an odd tile count included), the bf16 dequantisation too (its AVX-512 and scalar loops)."""
    from tokenops.engine.quantize.common import q8_tiles, quantize_q8_blocks
    from tokenops.engine.quantize.int4 import native_blocks, native_params

    if not needs <= cpu_info.cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_info.cpu_flags())}")
    torch.manual_seed(11)
    x = torch.randn(37, 200)
    x[3] *= 1e4  # a row whose block scales dwarf the others'
    q8 = (x, *q8_tiles(*quantize_q8_blocks(torch.randn(61, 200))), 61, torch.randn(61))
    codes = torch.randint(0, 16, (61, 256), dtype=torch.uint8)
    codes[:8] = 15  # the largest int16 pair sums AVX2's path keeps
    d, m = torch.rand(61, 4) * 0.02, torch.randn(61, 4) * 0.01
    q4 = (x, native_blocks(codes), native_params(d), native_params(m), 61, 64, None)
    deq = (q4[1], q4[2], q4[3], 61, 64)
    # 9 tiles of 8 rows: with AVX-512's tile pairs (calls of 8 rows or more) the last one is on its own
    codes_odd = torch.randint(0, 16, (67, 224), dtype=torch.uint8)
    d_odd, m_odd = (torch.rand(67, 7) * 0.02).half().float(), (torch.randn(67, 7) * 0.01).half().float()
    q4_odd = (
        x,
        native_blocks(codes_odd),
        native_params(d_odd).half(),
        native_params(m_odd).half(),
        67,
        32,
        torch.randn(67),
    )
    q8_odd = (x, *q8_tiles(*quantize_q8_blocks(torch.randn(67, 200))), 67, None)
    torch.save({"q8": q8, "q4": q4, "q4_odd": q4_odd, "q8_odd": q8_odd, "deq": deq}, tmp_path / "inputs.pt")
    csrc = ROOT / "src/tokenops/engine/kernels/csrc"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKS_BUILT_FOR,
            str(tmp_path),
            f"tokenops_blocks_{build}",
            march,
            str(csrc / "linear_blocks.cpp"),
            str(csrc / "isa.cpp"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    built = torch.load(tmp_path / "outputs.pt")
    assert built["dot"] == dot
    assert torch.equal(built["q8"], native.linear_q8(*q8))
    assert torch.equal(built["q4"], native.linear_q4(*q4))
    assert torch.equal(built["q4_odd"], native.linear_q4(*q4_odd))
    assert torch.equal(built["q8_odd"], native.linear_q8(*q8_odd))
    assert torch.equal(built["deq"], native.dequantize_q4_bf16(*deq))
