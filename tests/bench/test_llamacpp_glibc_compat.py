"""benchmarks/llamacpp_glibc_compat.py on a real shared library: the imports it rewrites still load
and run. The llama.cpp case (C23 imports at GLIBC_2.38) needs a newer glibc to build, so this builds
the same situation one glibc generation back: C99 `sscanf`, imported as `__isoc99_sscanf@GLIBC_2.7`."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def _compat():
    spec = importlib.util.spec_from_file_location(
        "llamacpp_glibc_compat", ROOT / "benchmarks" / "llamacpp_glibc_compat.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _library(tmp_path: Path) -> Path:
    src = tmp_path / "parse.c"
    src.write_text(
        '#include <stdio.h>\nint parse(const char *s) { int v = -1; sscanf(s, "%d", &v); return v; }\n'
    )
    lib = tmp_path / "libparse.so"
    subprocess.run(["cc", "-std=c99", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return lib


def test_rewrites_versioned_imports_to_the_classic_symbol_and_still_runs(tmp_path):
    compat = _compat()
    lib = _library(tmp_path)
    if "__isoc99_sscanf" not in compat.imported_names(lib):
        pytest.skip("this libc does not version sscanf as __isoc99_sscanf")
    assert compat.patch(lib, version=b"GLIBC_2.7", prefix=b"__isoc99_") == 1
    names = compat.imported_names(lib)
    assert "sscanf" in names and "__isoc99_sscanf" not in names
    parse = ctypes.CDLL(str(lib)).parse
    parse.argtypes = [ctypes.c_char_p]
    assert parse(b"1234") == 1234
    assert compat.patch(lib, version=b"GLIBC_2.7", prefix=b"__isoc99_") == 0  # already patched


def test_a_library_without_that_version_is_left_alone(tmp_path):
    compat = _compat()
    lib = _library(tmp_path)
    before = lib.read_bytes()
    assert compat.patch(lib) == 0  # no GLIBC_2.38 imports on this libc
    assert lib.read_bytes() == before
