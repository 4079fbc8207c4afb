"""`quantization="auto"`: the feature set of a CPU and the table's choice, as pure functions of made-up
CPUs (flags, ATen capability, kernel build target), and what an EngineConfig resolves on this one."""

from __future__ import annotations

import pytest

from tokenops.engine.config import EngineConfig
from tokenops.engine.quantize import MODES, auto_quantization
from tokenops.engine.quantize.auto import AUTO_TABLE, FEATURE_SETS, auto_quantization_for, cpu_feature_set

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_vnni", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "capability", "isa", "want"),
    [
        (AMX, "AVX512", "native", "amx"),
        (AVX512_BF16, "AVX512", "native", "avx512_bf16"),
        (AVX512_BF16 | {"avx512_fp16"}, "AVX512", "native", "avx512_bf16"),
        (AVX512, "AVX512", "native", "avx512"),
        (AVX2, "AVX2", "native", "avx2"),
        # an AMX machine held to AVX2 by ATEN_CPU_CAPABILITY or by the kernels' build target
        (AMX, "AVX2", "native", "avx2"),
        (AMX, "AVX512", "avx2", "avx2"),
        (AMX, "AVX512", "avx2_vnni", "avx2"),
        (AVX512, "AVX512", "avx512", "avx512"),
        # kernels built for x86-64's baseline (TOKENOPS_KERNEL_ISA=portable) take their scalar paths
        (AMX, "AVX512", "portable", "portable"),
        (AVX2, "AVX2", "portable", "portable"),
        ({"sse4_2"}, "DEFAULT", "native", "portable"),
        (AVX2, "DEFAULT", "native", "portable"),  # ATEN_CPU_CAPABILITY=default
        (set(), "DEFAULT", "native", "portable"),  # no /proc/cpuinfo (not Linux, not x86)
    ],
)
def test_feature_set_from_flags_capability_and_build_target(flags, capability, isa, want):
    assert cpu_feature_set(frozenset(flags), capability, isa) == want


@pytest.mark.parametrize(
    ("flags", "vendor", "want"),
    [
        (AVX512_BF16, "AuthenticAMD", "avx512_bf16"),  # Zen 4
        (AVX512_BF16 | {"avx512_fp16"}, "GenuineIntel", "avx512_bf16_intel"),  # a Xeon with AMX hidden
        (AVX512_BF16, "GenuineIntel", "avx512_bf16_intel"),  # Cooper Lake
        (AMX, "GenuineIntel", "amx"),
        (AVX512, "GenuineIntel", "avx512"),
        (AMX, "", "amx"),
        (AVX512_BF16, "", "avx512_bf16"),  # vendor unknown: the measured AVX512-BF16 kind's row
    ],
)
def test_avx512_bf16_splits_by_vendor_and_amx_does_not(flags, vendor, want):
    assert cpu_feature_set(frozenset(flags), "AVX512", "native", vendor) == want
    assert cpu_feature_set(frozenset(flags), "AVX2", "native", vendor) == "avx2"


def test_every_feature_set_has_a_row_of_a_known_mode():
    assert set(AUTO_TABLE) == set(FEATURE_SETS)
    assert set(AUTO_TABLE.values()) <= {None, *MODES}


def test_the_simd_kinds_take_int4_and_the_rest_float32():
    # int4 on the tiles: with AMX (vpdpbusd) far ahead of bf16 at a few streams and level at 32; on Zen 4
    # ahead of bf16 at 1-32 streams; on Intel without AMX ahead of bf16 and float32; on AVX2 ahead of W8A8
    for feature_set in ("amx", "avx512_bf16", "avx512_bf16_intel", "avx2"):
        assert auto_quantization_for(feature_set) == "int4"
    for feature_set in ("avx512", "portable"):
        assert auto_quantization_for(feature_set) is None


def test_unknown_feature_set_is_refused():
    with pytest.raises(ValueError, match="unknown CPU feature set 'neon'"):
        auto_quantization_for("neon")


def test_engine_config_resolves_auto_from_this_cpu_whatever_its_max_num_seqs():
    assert EngineConfig(quantization="auto", max_num_seqs=64).quantization == auto_quantization("cpu")
    assert EngineConfig(quantization="auto", max_num_seqs=1).quantization == auto_quantization("cpu")
    assert auto_quantization("meta") is None  # devices other than the CPU keep their dtype
