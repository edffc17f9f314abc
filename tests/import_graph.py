"""The import graph of weightcache's own modules, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts, at module level or inside a function: an import moved into a function
to dodge a cycle is still a cycle. Imports under ``if TYPE_CHECKING:`` are left out: no
interpreter runs them, they only name types for annotations.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"core": "weightcache.core", "adapters": "weightcache.adapters", "conformance": "weightcache.conformance"}


@attrs.frozen
class Edge:
    """``source`` imports ``target``, at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def modules() -> dict[str, Path]:
    """Every module of the three packages by its import name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def edges() -> list[Edge]:
    """Each import of one of our modules by another, with where it is written."""
    known = modules()
    found = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _typing_only_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in typing_only:
                for target in _targets(module, path.name == "__init__.py", node, known):
                    if target != module:
                        found.append(Edge(module, target, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def cycles(graph: list[Edge]) -> list[list[Edge]]:
    """The strongly connected components of more than one module, each as the edges that join it (Tarjan's algorithm)."""
    successors: dict[str, set[str]] = {}
    for edge in graph:
        successors.setdefault(edge.source, set()).add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(successors.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return [[e for e in graph if e.source in c and e.target in c] for c in components]


def _typing_only_lines(tree: ast.Module) -> set[int]:
    """The line numbers of imports inside ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``) blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                for inner in ast.walk(child):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        lines.add(inner.lineno)
    return lines


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules of ours that ``node`` imports (``from package import module`` names the module itself)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def place(module: str, foundation: frozenset[str], layers: tuple[str, ...]) -> str | None:
    """The layer of one of the core's modules: its folder under core/ when that is in ``layers``, ``"foundation"`` for
    the core package itself and the top-level modules named in ``foundation``, None for any other (in no layer)."""
    parts = module.split(".")[2:]  # after weightcache.core
    if not parts or (len(parts) == 1 and parts[0] in foundation):
        return "foundation"
    if parts[0] in layers:  # the folder's package or one of its modules
        return parts[0]
    return None


def upward(graph: list[Edge], foundation: frozenset[str], layers: tuple[str, ...]) -> list[Edge]:
    """The core's imports that point up: a layer may import the foundation, its own folder and the layers before it in
    ``layers`` (bottom first); the foundation imports only itself. Imports of modules in no layer are left to ``place``."""
    rank = {"foundation": -1, **{layer: i for i, layer in enumerate(layers)}}
    found = []
    for edge in graph:
        if not (edge.source.startswith("weightcache.core") and edge.target.startswith("weightcache.core")):
            continue
        source, target = place(edge.source, foundation, layers), place(edge.target, foundation, layers)
        if source is not None and target is not None and source != target and rank[target] > rank[source]:
            found.append(edge)
    return found
