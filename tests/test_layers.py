"""Imports point down the layers of DESIGN.md §2; no pickle anywhere in the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shoal"

# Lower number = lower layer. A module may import its own layer's package or lower ones.
LAYERS = {
    "api": 0, "lattice": 1, "storage": 2, "consistency": 3, "placement": 4, "replication": 5,
    "wire": 6, "transport": 7, "cluster": 8, "server": 9, "client": 9, "launch": 10, "integrations": 11,
}


def shoal_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n == "shoal" or n.startswith("shoal.")]


def test_imports_point_down_the_layers():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            continue  # the top-level package assembles the public API from every layer
        layer = rel.parts[0]
        assert layer in LAYERS, f"{rel}: folder {layer!r} is not a layer of DESIGN.md §2"
        for name in shoal_imports(path):
            parts = name.split(".")
            target = parts[1] if len(parts) > 1 else ""
            if target not in LAYERS:
                violations.append(f"{rel} imports {name}")
            elif target != layer and LAYERS[target] >= LAYERS[layer]:
                violations.append(f"{rel} ({layer}) imports {name} ({target})")
    assert not violations, "\n".join(violations)


def test_no_pickle_in_the_package():
    for path in PACKAGE.rglob("*.py"):
        for name in ("pickle", "cloudpickle", "dill", "marshal"):
            imported = [n for n in ast.walk(ast.parse(path.read_text()))
                        if isinstance(n, (ast.Import, ast.ImportFrom))
                        and name in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module])]
            assert not imported, f"{path} imports {name}"
