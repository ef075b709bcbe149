"""The package's layers import one way: entry points -> engine -> executor -> worker -> models
and kernels; the scheduling core (requests, budget, KV bookkeeping) knows nothing of tensors,
models or executors, and models know nothing of requests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fulcrum"

FORBIDDEN = {
    "core": ("fulcrum.worker", "fulcrum.executor", "fulcrum.models", "fulcrum.kernels",
             "fulcrum.engine", "fulcrum.server", "fulcrum.distributed", "torch"),
    "worker": ("fulcrum.executor", "fulcrum.engine", "fulcrum.server", "fulcrum.llm",
               "fulcrum.async_engine"),
    "models": ("fulcrum.core", "fulcrum.worker", "fulcrum.executor", "fulcrum.engine",
               "fulcrum.server"),
    "executor": ("fulcrum.engine", "fulcrum.server", "fulcrum.llm", "fulcrum.async_engine"),
    "distributed": ("fulcrum.core", "fulcrum.worker", "fulcrum.executor", "fulcrum.engine",
                    "fulcrum.server"),
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module == "fulcrum":
                yield from (f"fulcrum.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_go_one_way(layer):
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in _imports(path):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[layer]):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not found, "\n".join(found)
