"""A native kernel source file as of a git revision, built on the side under its own op namespace, so
that a benchmark can time this tree's kernel and the revision's in one process (interleaved calls,
the same inputs, a bitwise check): `build_revision(rev, "paged_attention.cpp").paged_decode_attention`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenops.engine import kernels

CSRC = Path(kernels.__file__).parent / "csrc"


def build_revision(rev: str, source: str) -> object:
    """torch.ops.tokenops_<rev>_<isa>: csrc/`source` as of git revision `rev`, compiled with this
    build's flags (`TOKENOPS_KERNEL_ISA` included); the headers it includes are this tree's."""
    src = subprocess.run(
        ["git", "show", f"{rev}:src/tokenops/engine/kernels/csrc/{source}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    ns = f"tokenops_{rev[:12]}_{kernels.kernel_isa()}".replace("-", "_")
    src = src.replace("TORCH_LIBRARY_FRAGMENT(tokenops, m)", f"TORCH_LIBRARY({ns}, m)")
    build = Path(tempfile.gettempdir()) / f"{Path(source).stem}_{ns}"
    build.mkdir(exist_ok=True)
    (build / source).write_text(src)
    path = os.environ.get("PATH", "")
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    except ImportError:
        pass
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=ns,
        sources=[str(build / source)],
        extra_cflags=[*kernels.cflags(), f"-I{CSRC}"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
    )
    return getattr(torch.ops, ns)
