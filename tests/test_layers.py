"""Imports point down the layers of DESIGN.md §2, without circles inside a layer; no pickle anywhere."""

from __future__ import annotations

import ast
import re
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


def module_imports() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports, those imported only for type
    checking included: an import circle for annotations still ties the modules together."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {t for t in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if t in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_import_circles():
    assert not import_circles(module_imports()), import_circles(module_imports())


def test_an_import_circle_is_found():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_pickle_in_the_package():
    for path in PACKAGE.rglob("*.py"):
        for name in ("pickle", "cloudpickle", "dill", "marshal"):
            imported = [n for n in ast.walk(ast.parse(path.read_text()))
                        if isinstance(n, (ast.Import, ast.ImportFrom))
                        and name in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module])]
            assert not imported, f"{path} imports {name}"


def test_each_package_map_lists_its_modules():
    """Every package's docstring maps its modules (``- ``name``: what it is``), all and only them."""
    stale = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        listed = set(re.findall(r"^- ``(\w+)``:", ast.get_docstring(ast.parse(init.read_text())) or "", re.M))
        present = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
        present |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()}
        if listed != present:
            stale.append(f"{init.parent.name}: missing {sorted(present - listed)}, gone {sorted(listed - present)}")
    assert not stale, "\n".join(stale)


def test_the_readme_tree_shows_every_layer():
    readme = (PACKAGE.parents[1] / "README.md").read_text()
    tree = readme[readme.index("## How it works"):].split("```")[1]
    shown = set(re.findall(r"^  (\w+)/", tree, re.M))
    assert shown == set(LAYERS), (sorted(set(LAYERS) - shown), sorted(shown - set(LAYERS)))


#: the one place on each side that looks at a table's kind: it picks the access (worker) or service (server)
KIND_PICKERS = {Path("client/table.py"), Path("server/server.py")}


def test_only_the_pickers_branch_on_the_kind_of_table():
    found = []
    for side in ("client", "server"):
        for path in (PACKAGE / side).rglob("*.py"):
            rel = path.relative_to(PACKAGE)
            for node in ast.walk(ast.parse(path.read_text())):
                # ``spec.replicated``, ``x.spec.adaptive``: reading the kind off a table's spec
                if isinstance(node, ast.Attribute) and node.attr in ("replicated", "adaptive") and (
                        (isinstance(node.value, ast.Name) and node.value.id == "spec")
                        or (isinstance(node.value, ast.Attribute) and node.value.attr == "spec")):
                    found.append(f"{rel}:{node.lineno}")
    assert all(Path(f.split(":")[0]) in KIND_PICKERS for f in found), found
    assert found  # the pickers do read it: the check sees what it looks for
