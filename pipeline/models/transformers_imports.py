"""transformers' import structure, kept between processes, so that each run_shards process imports transformers
in a fraction of the time.

transformers 5 finds what it exports by reading its sources when it is imported: `define_import_structure`
reads every file under `transformers/models` (about 3,400) for its `__all__` and `@requires` lines, once for
the package and again for `transformers.models`, 1.5-3 CPU s in each process on a 2-core VM. Every command
that plans a run and every worker pays it, before its first batch. The structure is a function of those files
alone, so it is kept in `$RUN_SHARDS_CACHE/transformers/` under the scanned folder, the caller's arguments and
transformers' version, with a fingerprint of every file the scan reads (name, size, modification and change
times): a changed, added or removed source file, or another transformers, is scanned again. The kept
structure is the one transformers computed, as JSON (sets as sorted lists); anything unexpected (an
unreadable or unwritable cache, a transformers without this function) falls back to transformers' own scan.
"""
from __future__ import annotations

# (hashlib and json are imported where the structure is read or kept: a command that never imports transformers,
# `run_shards --help`, pays only for this module's import hook)
import importlib.machinery
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SCANNER = "transformers.utils.import_utils"
KEPT_FORMAT = 1
_fingerprints: dict[str, str] = {}   # (transformers scans `models` twice in a process: read its files once)


def keep_import_structure(cache: Path | None = None) -> bool:
    """Have transformers' import structure kept in `cache` (default `$RUN_SHARDS_CACHE/transformers`) for
    transformers' first import in this process. False where transformers is imported already (its scan is
    done) or this was asked before."""
    if SCANNER in sys.modules or "transformers" in sys.modules:
        return False
    if any(isinstance(f, _ScannerFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _ScannerFinder(cache))   # (the cache folder found when transformers is imported:
    return True                                      # commands that never import it pay nothing, not even numpy)


class _ScannerFinder:
    """A meta path finder (find_spec is all the import system asks of one; importlib.abc's base class costs a
    --help 8 ms): finds transformers' scanner module as the path finder would, and wraps `define_import_structure`
    in it once the module has run (transformers' own `__init__` then imports the wrapped function from it)."""

    def __init__(self, cache: Path | None):
        self.cache = cache

    def find_spec(self, name, path, target=None):
        if name != SCANNER:
            return None
        sys.meta_path.remove(self)   # once: the module is loaded once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module, cache = spec.loader.exec_module, self.cache
        if cache is None:
            from index.cache import cache_dir
            cache = cache_dir() / "transformers"

        def exec_module(module):
            run_module(module)
            scan = getattr(module, "define_import_structure", None)
            if callable(scan):
                module.define_import_structure = kept_scan(scan, cache, _version(module))
        spec.loader.exec_module = exec_module
        return spec


def _version(module) -> str:
    """transformers' version: its package sets it first thing, before it imports the scanner."""
    package = sys.modules.get("transformers")
    found = getattr(package, "__version__", None)
    if isinstance(found, str) and found:
        return found
    from importlib.metadata import PackageNotFoundError, version   # (0.07 s: only where the package said none)
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "unknown:" + os.path.realpath(getattr(module, "__file__", "") or "")


def kept_scan(scan, cache: Path, version: str):
    """`scan` (transformers' define_import_structure), answered from `cache` where it scanned the same files."""
    import hashlib
    def define_import_structure(module_path, prefix=None, *args, **kwargs):
        if args or kwargs:   # (a later transformers' arguments: its own scan, as it is)
            return scan(module_path, prefix, *args, **kwargs)
        try:
            folder = os.path.realpath(os.fspath(module_path))
            if os.path.isfile(folder):   # (transformers scans the folder of a file it is given)
                folder = os.path.dirname(folder)
            place = cache / (hashlib.sha256(f"{KEPT_FORMAT}\0{version}\0{folder}\0{os.fspath(module_path)}\0"
                                             f"{prefix}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
                             + ".json")
            if folder not in _fingerprints:
                _fingerprints[folder] = fingerprint(folder)
            stamp = _fingerprints[folder]
        except (OSError, TypeError, ValueError):
            return scan(module_path, prefix)
        kept = _read(place, stamp)
        if kept is not None:
            return kept
        structure = scan(module_path, prefix)
        _keep(place, stamp, structure)
        return structure
    define_import_structure.__wrapped__ = scan
    return define_import_structure


def fingerprint(folder: str) -> str:
    """sha256 over what transformers' scan reads below `folder`: every folder's name and every file's name, size,
    modification and change times (any write sets the change time), in a fixed order."""
    import hashlib
    h = hashlib.sha256()
    pending = [folder]
    while pending:
        here = pending.pop()
        with os.scandir(here) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            if entry.name == "__pycache__":
                continue
            if entry.is_dir():
                h.update(f"d\0{entry.path}\n".encode("utf-8", "surrogateescape"))
                pending.append(entry.path)
            else:
                st = entry.stat()
                h.update(f"f\0{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n"
                         .encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _read(place: Path, stamp: str):
    import json
    try:
        kept = json.loads(place.read_text(encoding="utf-8"))
        if kept.get("fingerprint") != stamp:
            return None
        return {frozenset(backends): {module: set(names) for module, names in modules.items()}
                for backends, modules in kept["structure"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _keep(place: Path, stamp: str, structure) -> None:
    import json

    from ..rundir.layout import write_atomic
    try:
        text = json.dumps({"fingerprint": stamp,
                           "structure": [[sorted(backends), {m: sorted(n) for m, n in modules.items()}]
                                         for backends, modules in structure.items()]})
    except (TypeError, ValueError, AttributeError):   # (a structure of another shape: not kept)
        return
    try:
        place.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(place, text)   # (whole or not at all, for processes reading it at the same time)
    except OSError as e:
        log.debug("transformers' import structure not kept in %s: %s", place.parent, e)
