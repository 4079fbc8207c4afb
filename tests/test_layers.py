"""The import graph between packages: which layer may import which, read from the source with `ast`.

Every import counts, also the lazy ones inside functions and under TYPE_CHECKING: a layer that
reaches into another only at call time still depends on it. The engine is a backend the gateway
speaks HTTP to and `tokenops serve` starts as a process, so nothing outside it imports it in process
except the top-level CLI, which registers the `tokenops engine` command.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenops

SRC = Path(tokenops.__file__).parent

# package (or top-level module) -> packages it must never import
FORBIDDEN = {
    "cache": {"engine", "gateway", "sim"},
    "cluster": {"engine", "gateway", "sim"},
    "fusion": {"engine", "gateway", "sim"},
    "gateway": {"engine", "sim"},
    "ops": {"engine", "gateway", "sim"},
    "bench": {"engine", "sim"},
    "modelfiles": {"engine", "gateway", "cluster", "cache", "fusion", "ops", "bench", "sim"},
    "config": {"ops", "engine", "gateway"},
    "embeddings": {"engine"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports_of(source: str, package: str) -> set[str]:
    """The tokenops layers a module of `package` imports, lazy imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
            elif node.module:
                names = [node.module]
            if names == ["tokenops"]:  # from tokenops import config
                names = [f"tokenops.{a.name}" for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("tokenops.")}
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        layer = _layer(path)
        package = ".".join(("tokenops", *path.relative_to(SRC).parts[:-1]))
        graph.setdefault(layer, set()).update(imports_of(path.read_text(), package) - {layer})
    return graph


def test_no_layer_imports_what_it_must_not() -> None:
    graph = import_graph()
    bad = {layer: sorted(graph.get(layer, set()) & banned) for layer, banned in FORBIDDEN.items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_shared_model_files_are_used_where_the_engine_was() -> None:
    graph = import_graph()
    assert "modelfiles" in graph["cluster"] and "modelfiles" in graph["embeddings"]
    assert "modelfiles" in graph["engine"]


def test_only_the_cli_imports_the_engine() -> None:
    graph = import_graph()
    assert sorted(layer for layer, deps in graph.items() if "engine" in deps) == ["cli"]


def test_the_scanner_sees_lazy_relative_and_package_imports() -> None:
    # a scanner that missed these would pass every test above while the layers leak
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tokenops import ops\n"
        "def f():\n    from ..engine import llm_engine\n    import tokenops.gateway.app\n"
        "from .policies import Policy\n"
    )
    assert imports_of(source, "tokenops.cluster") == {"ops", "engine", "gateway", "cluster"}
