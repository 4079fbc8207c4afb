"""Native CPU kernels of the engine (paged attention, small-row matmuls on compressed weights, the norms
and row passes around them): C++ in `csrc/*.cpp`, registered as torch ops (`torch.ops.tokenops.*`,
one `TORCH_LIBRARY_FRAGMENT` per file) and compiled by `torch.utils.cpp_extension` with
`-O3 -march=native` the first time `ops()` is called (`LLMEngine`'s builder calls it, so no request
waits for a build) into `$TOKENOPS_CACHE_DIR/kernels/<key>`; the key hashes the sources and headers,
the flags, torch's version and the CPU's feature flags, so a later start loads the library in
milliseconds and a cache shared between CPUs never hands one a binary built for another. Nothing
depends on them: `ops()` returns None when they are off (`TOKENOPS_NATIVE_KERNELS=0`, or
`kernels.enabled = False`), the device is not a CPU, or the build fails, and every caller keeps its
PyTorch path, which the tests compare each kernel with. Build ahead: `python -m tokenops.engine.kernels`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from tokenops import cpu_info

__all__ = ["ISA_FLAGS", "build_error", "cflags", "enabled", "kernel_isa", "ops"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# TOKENOPS_KERNEL_ISA -> the -march the kernels are built for; each source picks its AVX-512, AVX2 or
# portable path from the macros that flag defines (`torch.ops.tokenops.compiled_isa()` reports which)
# ("portable": x86-64's baseline, SSE2 only, so every kernel takes its scalar path: the fallback a CPU
# without AVX2 runs, buildable anywhere to test it; "avx2_vnni": AVX2 plus AVX-VNNI's 256-bit vpdpbusd,
# what Intel's cores since Alder Lake and AMD's since Zen 5 add to AVX2; `compiled_int8_dot()` reports it)
ISA_FLAGS = {
    "native": "-march=native",
    "avx2": "-march=x86-64-v3",
    "avx2_vnni": "-march=x86-64-v3 -mavxvnni",
    "avx512": "-march=x86-64-v4",
    "portable": "-march=x86-64",
}


def kernel_isa() -> str:
    """The build target `TOKENOPS_KERNEL_ISA` selects ("native" when unset); ValueError if unknown."""
    isa = os.environ.get("TOKENOPS_KERNEL_ISA", "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"TOKENOPS_KERNEL_ISA={isa!r}: use one of {', '.join(ISA_FLAGS)}")
    return isa


def cflags() -> list[str]:
    return ["-O3", *ISA_FLAGS[kernel_isa()].split(), "-mtune=native", "-fopenmp", "-std=c++17"]


_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    return cpu_info.cpuinfo_field("flags") or platform.processor() or platform.machine()


def _build_key(sources: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(str(CSRC).encode())  # the build records source paths: two checkouts must not share a folder
    for src in [*sources, *sorted(CSRC.glob("*.h"))]:  # the headers they include too
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(cflags()).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()


def _build() -> None:
    """Load the library built for this key, building it first if there is none.

    The build runs under an exclusive `flock` on a file next to it, which the OS releases if this
    process dies (a killed first start must not leave later ones waiting): concurrent starts wait
    for one build, and torch's own lock file, stale whenever we hold ours, is cleared before it.
    A finished library is loaded directly, without ninja or torch's lock."""
    from tokenops.modelfiles.files import default_cache_dir

    sources = sorted(CSRC.glob("*.cpp"))
    key = _build_key(sources)
    build_dir = default_cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"tokenops_kernels_{key}.so"
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # truncated by a build that died while linking: build it again
            library.unlink(missing_ok=True)
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if library.is_file():  # another process built it while this one waited
            torch.ops.load_library(str(library))
            return
        (build_dir / "lock").unlink(missing_ok=True)
        started = time.perf_counter()
        log.info("building the native CPU kernels (once per source version and CPU) ...")
        compile_library(f"tokenops_kernels_{key}", sources, build_dir)
        log.info("native CPU kernels built in %.1f s", time.perf_counter() - started)


def compile_library(
    name: str, sources: list[Path], build_dir: Path, extra_cflags: tuple[str, ...] = ()
) -> None:
    """Build and load the library `name` from `sources` with this build's flags (plus `extra_cflags`):
    cpp_extension's build, which loads the library too, with the `ninja` wheel's binary on PATH where
    no ninja is installed system-wide. The engine's kernels and benchmarks' side builds of a revision."""
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    try:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=[*cflags(), *extra_cflags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path


# read on every call (a module attribute, not the environment: ops() runs several times per layer)
enabled = os.environ.get("TOKENOPS_NATIVE_KERNELS", "1") != "0"


def ops(device: torch.device | str = "cpu") -> object | None:
    """`torch.ops.tokenops` once the kernels are built and loaded; None where they are unavailable."""
    if (
        not enabled
        or (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cpu"
    ):
        return None
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _build()
                    _state["ok"] = True
                except Exception as exc:  # no compiler, no ninja, a compile error: fall back, say why once
                    _state["error"] = f"{type(exc).__name__}: {exc}"
                    _state["ok"] = False
                    log.warning("native CPU kernels unavailable, using PyTorch ops: %s", str(exc)[:500])
    return torch.ops.tokenops if _state["ok"] else None


def build_error() -> str | None:
    """Why the last build failed (None: it did not fail, or was not attempted)."""
    return _state.get("error")  # type: ignore[return-value]
