"""The /proc/cpuinfo reader every CPU-dependent choice asks."""

import platform
from pathlib import Path

import pytest

from tokenops import cpu_info

# the head of one core's block on an Intel machine with VMX: "vmx flags" comes after "flags"
INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
vmx flags\t: vnmi ept
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
"""


def test_field_of_matches_the_whole_key_of_the_first_block():
    assert cpu_info.field_of(INTEL, "flags") == "fpu sse2 avx2 avx512f avx512_bf16"
    assert cpu_info.field_of(INTEL, "vmx flags") == "vnmi ept"
    assert cpu_info.field_of(INTEL, "model name") == "Intel(R) Xeon(R) Processor"
    assert cpu_info.field_of(INTEL, "model") == "207"
    assert cpu_info.field_of(INTEL, "vendor_id") == "GenuineIntel"
    assert cpu_info.field_of(INTEL, "microcode") == ""
    assert cpu_info.field_of("", "flags") == ""


@pytest.mark.skipif(
    not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64", reason="x86-64 Linux only"
)
def test_this_machine_reads_as_an_x86_64_cpu():
    flags = cpu_info.cpu_flags()
    assert {"sse2", "avx2", "fma"} <= flags  # the kernels' AVX2 build target needs these
    assert cpu_info.cpu_vendor() in {"GenuineIntel", "AuthenticAMD"}
