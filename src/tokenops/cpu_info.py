"""This machine's CPU as /proc/cpuinfo describes it: the one place that reads the file (the kernels'
build key, `quantization="auto"`'s feature set and the benchmarks' machine records all ask here)."""

from __future__ import annotations

import functools
from pathlib import Path


def field_of(text: str, field: str) -> str:
    """The value of the first line of cpuinfo `text` whose key is exactly `field` (so "flags" is not
    Intel's later "vmx flags" line), or ""."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == field:
            return value.strip()
    return ""


@functools.cache
def cpuinfo_field(field: str) -> str:
    """`field` of this machine's /proc/cpuinfo ("" off Linux or when absent)."""
    try:
        return field_of(Path("/proc/cpuinfo").read_text(), field)
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`avx2`, `avx512_bf16`, `amx_tile`, ...); empty off Linux."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """`vendor_id`: GenuineIntel, AuthenticAMD, or "" off Linux."""
    return cpuinfo_field("vendor_id")
