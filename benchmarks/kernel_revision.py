"""A native kernel source file as of a git revision, built on the side under its own op namespace, so
that a benchmark can time this tree's kernel and the revision's in one process (interleaved calls,
the same inputs, a bitwise check): `build_revision(rev, "paged_attention.cpp").paged_decode_attention`.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch

from tokenops.engine import kernels


def build_revision(rev: str, source: str) -> object:
    """torch.ops.tokenops_<rev>_<isa>: csrc/`source` as of git revision `rev`, compiled with this
    build's flags (`TOKENOPS_KERNEL_ISA` included) and with the revision's headers beside it (a
    kernel's code may live in a header it includes)."""
    # named by the commit, not by `rev` (HEAD or a branch moves, and the build folder outlives the run)
    commit = subprocess.run(
        ["git", "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    src = subprocess.run(
        ["git", "show", f"{commit}:src/tokenops/engine/kernels/csrc/{source}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    ns = f"tokenops_{commit[:12]}_{kernels.kernel_isa()}".replace("-", "_")
    src = src.replace("TORCH_LIBRARY_FRAGMENT(tokenops, m)", f"TORCH_LIBRARY({ns}, m)")
    build = Path(tempfile.gettempdir()) / f"{Path(source).stem}_{ns}"
    build.mkdir(exist_ok=True)
    (build / source).write_text(src)
    csrc = "src/tokenops/engine/kernels/csrc/"
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", commit, csrc], check=True, capture_output=True, text=True
    ).stdout.split()
    for name in (n for n in names if n.endswith(".h")):  # found before this tree's: beside the source
        header = subprocess.run(
            ["git", "show", f"{commit}:{name}"], check=True, capture_output=True, text=True
        )
        (build / Path(name).name).write_text(header.stdout)
    kernels.compile_library(ns, [build / source], build, (f"-I{kernels.CSRC}",))
    return getattr(torch.ops, ns)
