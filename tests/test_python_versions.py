"""The code runs on every Python that setup.cfg admits (python_requires), not only on CI's 3.11: each module
parses with the oldest one's grammar and uses no standard-library name that is newer than it, nor a module
that a later Python removed. (3.10, 3.12 and 3.13 ran `make demo` and a slice of the suite by hand; this
keeps what a 3.11-only test run cannot see from creeping in.)"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from .tiny_models import REPO

ROOMS = ("pipeline", "index", "triton_kernels", "run_shards", "tests", "tools", "bench")

# Names added after 3.10 that code written on 3.11+ reaches for (module, name) -> the Python that added it.
NEWER = {("tomllib", None): (3, 11), ("typing", "Self"): (3, 11), ("typing", "LiteralString"): (3, 11),
         ("typing", "Never"): (3, 11), ("typing", "assert_never"): (3, 11), ("typing", "reveal_type"): (3, 11),
         ("typing", "Required"): (3, 11), ("typing", "NotRequired"): (3, 11), ("typing", "Unpack"): (3, 11),
         ("typing", "TypeVarTuple"): (3, 11), ("typing", "dataclass_transform"): (3, 11),
         ("typing", "override"): (3, 12), ("typing", "TypeAliasType"): (3, 12), ("datetime", "UTC"): (3, 11),
         ("enum", "StrEnum"): (3, 11), ("enum", "verify"): (3, 11), ("asyncio", "TaskGroup"): (3, 11),
         ("asyncio", "timeout"): (3, 11), ("hashlib", "file_digest"): (3, 11), ("contextlib", "chdir"): (3, 11),
         ("itertools", "batched"): (3, 12), ("warnings", "deprecated"): (3, 13), ("copy", "replace"): (3, 13)}
BUILTINS = {"ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11)}
# Modules Python 3.12 and 3.13 removed (PEP 594, PEP 632).
REMOVED = {"distutils", "imp", "asynchat", "asyncore", "smtpd", "aifc", "audioop", "cgi", "cgitb", "chunk",
           "crypt", "imghdr", "mailcap", "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd",
           "sunau", "telnetlib", "uu", "xdrlib", "lib2to3"}


def oldest() -> tuple[int, int]:
    spec = re.search(r"^python_requires\s*=\s*>=\s*(\d+)\.(\d+)\s*$", (REPO / "setup.cfg").read_text(), re.M)
    assert spec, "setup.cfg: python_requires = >=X.Y"
    return int(spec.group(1)), int(spec.group(2))


def sources() -> list[Path]:
    files = [p for room in ROOMS for p in sorted((REPO / room).rglob("*.py")) if ".venv" not in p.parts]
    return files + [REPO / "bin" / "run_shards"]


def test_every_module_parses_with_the_oldest_pythons_grammar():
    version = oldest()
    wrong = []
    for path in sources():
        try:
            ast.parse(path.read_text(), str(path), feature_version=version)
        except SyntaxError as e:
            wrong.append(f"{path.relative_to(REPO)}:{e.lineno}: {e.msg}")
    assert len(sources()) > 100 and wrong == []


def newer_names(tree: ast.AST, version: tuple[int, int]) -> list[str]:
    """`import M` / `from M import N` / `M.N` of the NEWER names, builtins of BUILTINS, and REMOVED modules."""
    found = []
    for node in ast.walk(tree):
        uses = []
        if isinstance(node, ast.Import):
            uses = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            uses = [(node.module, None)] + [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses = [(node.value.id, node.attr)]
        elif isinstance(node, ast.Name) and node.id in BUILTINS and BUILTINS[node.id] > version:
            found.append(f"{node.lineno}: {node.id} (Python {'.'.join(map(str, BUILTINS[node.id]))})")
        for module, name in uses:
            added = NEWER.get((module, name))
            if added and added > version:
                found.append(f"{node.lineno}: {module}{'.' + name if name else ''} (Python "
                             f"{'.'.join(map(str, added))})")
            if name is None and module.split(".")[0] in REMOVED:
                found.append(f"{node.lineno}: {module} (removed in Python 3.12/3.13)")
    return found


def test_no_standard_library_name_newer_than_the_oldest_python_nor_one_removed_since():
    version = oldest()
    wrong = [f"{path.relative_to(REPO)}:{use}" for path in sources()
             for use in newer_names(ast.parse(path.read_text()), version)]
    assert wrong == []


@pytest.mark.parametrize("code", ["from typing import Self", "import tomllib", "x = datetime.UTC",
                                  "itertools.batched(a, 2)", "except_ = ExceptionGroup('', [])", "import imp",
                                  "from distutils.version import LooseVersion"])
def test_the_check_sees_what_3_11_runs_and_3_10_or_3_13_does_not(code):
    assert newer_names(ast.parse(code), (3, 10)), code


def test_the_readme_names_the_same_oldest_python_as_setup_cfg():
    readme = (REPO / "README.md").read_text()
    assert "`python3` ({}.{}+)".format(*oldest()) in readme


@pytest.mark.parametrize("code", ["try:\n    pass\nexcept* ValueError:\n    pass", "type Rows = list[int]",
                                  "def first[T](xs: list[T]) -> T: ...", "f'{'nested'}'"])
def test_the_grammar_check_refuses_what_3_10_cannot_parse(code):
    with pytest.raises(SyntaxError):
        ast.parse(code, feature_version=(3, 10))
