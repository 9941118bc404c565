"""The import graph of the product packages (module- and function-level imports, from the source alone),
for the architecture tests: which modules import which, and its cycles."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("run_shards", "pipeline", "index", "triton_kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imported(node: ast.AST, here: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = here.split(".") if is_package else here.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            root = ".".join(base + ([node.module] if node.module else []))
        else:
            root = node.module or ""
        # `from pkg import sub` imports the submodule when there is one
        names = [f"{root}.{a.name}" if f"{root}.{a.name}" in known else root for a in node.names]
    else:
        return []
    out = []
    for name in names:
        while name and name not in known:   # `import a.b.c` where c is an attribute
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def graph() -> dict[str, set[str]]:
    """module -> the product modules it imports anywhere in its body."""
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for target in _imported(node, name, path.name == "__init__.py", known):
                if target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    import sys
    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
