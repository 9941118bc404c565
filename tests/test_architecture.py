"""The tree is the architecture diagram (docs/DESIGN.md, "Rooms"): no import cycles between modules or
between rooms, and the parent-side rooms never import torch at module level, so `index`, `status`,
`report` and planning stay fast on a login node. run_shards/, the package users import, only names what
the rooms hold (docs/python.md says what it names)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

from .import_graph import REPO, cycles, graph, modules

# Rooms of pipeline/ that run in the parent (or on a login node): importing any of their modules must not
# import torch (or transformers, which imports torch).
TORCH_FREE_ROOMS = ("planning", "rundir", "output", "reporting", "commands")


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 else parts[0]


def test_no_module_import_cycles():
    assert cycles(graph()) == []


# The rooms, top down (docs/DESIGN.md, "Rooms"): a module imports only from its own room or a lower one.
ORDER = ("run_shards", "cli", "commands", "api", "reporting", "launchers", "planning", "worker", "tasks", "engine",
         "models", "output", "rundir", "host_memory", "config", "faults", "exits", "errors", "processes", "cgroups",
         "advice", "pipeline", "index", "triton_kernels")


def test_rooms_import_downwards():
    """Module-level and function-level imports between rooms all go down ORDER (e.g. output never imports the
    worker, models never import the engine), so the rooms form no cycle either."""
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                    if ORDER.index(_room(b)) < ORDER.index(_room(a)))
    assert upward == []


def test_every_room_is_placed():
    assert {_room(m) for m in modules()} == set(ORDER)


def test_parent_rooms_do_not_import_torch():
    names = sorted(m for m in modules() if m.split(".")[0] == "pipeline" and _room(m) in TORCH_FREE_ROOMS)
    assert len(names) > 15, names
    names.append("run_shards")   # reading a result imports no torch either
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers', 'triton'):\n"
            "            raise ImportError(f'{name} imported at module level')\n"
            "sys.meta_path.insert(0, Block())\n"
            f"import importlib\nfor m in {names!r}:\n    importlib.import_module(m)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_public_package_only_names_what_the_rooms_hold():
    """run_shards/ holds imports from the rooms, its `__all__` and its docstring: no code of its own (a
    function there would be a room no diagram shows), every name it imports is in `__all__` and the
    reverse, no room imports it back, and docs/python.md documents each public name."""
    package = [m for m in modules() if _room(m) == "run_shards"]
    assert package == ["run_shards"], package
    tree = ast.parse((REPO / "run_shards" / "__init__.py").read_text())
    imported, listed = [], None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] in ORDER, ast.unparse(node)
            imported += [a.asname or a.name for a in node.names]
        elif isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]:
            listed = ast.literal_eval(node.value)
        else:
            assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0], \
                f"run_shards/__init__.py line {node.lineno}: only imports, __all__ and the docstring belong there"
    assert listed is not None and sorted(listed) == sorted(imported) and len(set(listed)) == len(listed)
    assert [m for m, targets in graph().items() if "run_shards" in targets] == []
    documented = set(re.findall(r"`run_shards\.(\w+)", (REPO / "docs" / "python.md").read_text()))
    assert set(listed) - {"__version__"} <= documented, sorted(set(listed) - documented)
