"""The index cache: reuse a saved index while every input keeps its size, modification and change times and
inode (input_file.py), else rebuild (or when asked: an edit that keeps all of them, on a file system with
coarse times, goes unseen until a record's checksum tells it).

Cache files live in `$RUN_SHARDS_CACHE` (default `$XDG_CACHE_HOME/run_shards` or `~/.cache/run_shards`),
under `index/`, named by a hash of the inputs' absolute paths. A truncated or corrupt cache file is
detected by its checksum and rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Sequence

from .build import check_regular, refuse_repeated
from .compressed import kind as compression, readable_paths
from .errors import FastaError
from .sequence_index import FORMAT_VERSION, IndexCorrupt, InputFile, SequenceIndex, some

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """$RUN_SHARDS_CACHE (an empty value is unset), made absolute with its `~` expanded: a relative or quoted
    `~/cache` would name another folder for each current directory (a SLURM task starts in the submit folder)."""
    root = os.environ.get("RUN_SHARDS_CACHE")
    if root:
        return Path(root).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "run_shards"


def cache_path(paths: Sequence[str | os.PathLike], directory: Path | None = None) -> Path:
    key = "\0".join(os.path.abspath(os.fspath(p)) for p in paths)
    # (s2: caches that record each input's change time and inode; an older run_shards sharing the cache
    # keeps its own files, under other names)
    digest = hashlib.sha1(f"v{FORMAT_VERSION}s2\0{key}".encode()).hexdigest()[:20]
    return (directory or cache_dir()) / "index" / f"{digest}.rsidx"


def load_or_build(paths: Sequence[str | os.PathLike], directory: Path | None = None,
                  threads: int | None = None, rebuild: bool = False, progress: bool = True
                  ) -> tuple[SequenceIndex, bool]:
    """The index of `paths` and whether it came from the cache. BGZF files are indexed in place; other gzip
    files through their decompressed copies (compressed.py), which the index then names; an error in the text
    of either names the compressed file. `rebuild`: index the files anew whatever the cache holds (an edit
    that kept a file's size and every time stat shows, on a file system with coarse times, leaves a cache
    that looks current: `run_shards index --rebuild`)."""
    sources = [os.fspath(p) for p in paths]
    check_regular(sources)   # (before anything reads a pipe's first bytes)
    refuse_repeated(sources)   # (before a cached index of them is reused: an index built before this check)
    paths = readable_paths(paths, directory or cache_dir(), progress)   # (progress: a .gz's decompression bar)
    path = cache_path(paths, directory)
    if path.exists() and not rebuild:
        try:
            index = SequenceIndex.load(path)
            current = [InputFile.stat(p) for p in paths]
            if [f.state for f in current] == [f.state for f in index.inputs]:   # (all of it: see input_file.py)
                if index.checksums is not None:
                    return index, True
                log.info("index cache %s predates record checksums; rebuilding", path)
            else:
                log.info("index cache %s is stale (an input changed); rebuilding", path)
        except IndexCorrupt as e:
            log.warning("index cache is corrupt (%s); rebuilding", e)
        except (OSError, ValueError, KeyError) as e:
            log.warning("index cache %s unreadable (%s); rebuilding", path, e)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path
    except OSError as e:  # a read-only cache is not fatal: the index just is not reused
        log.warning("could not write the index cache %s: %s", path, e)
        target = None
    try:
        try:
            return SequenceIndex.build(paths, threads, target), False
        except OSError as e:
            if target is None or isinstance(e, FileNotFoundError) and e.filename != os.fspath(target):
                raise
            log.warning("could not write the index cache %s: %s", path, e)
            return SequenceIndex.build(paths, threads), False
    except FastaError as e:   # found in the text of a compressed file: name the file the user gave
        source = dict(zip(paths, sources)).get(e.path)
        if source is not None and compression(source) is not None:
            raise e.in_text_of(source) from None
        raise


def records_changed(index: SequenceIndex) -> str | None:
    """What changed in the FASTA files since `index` was built, or None when their records and bytes are the
    same (a file only touched, same bytes, is accepted). Where a stat moved, the files are indexed again through
    the cache, so that a file whose times or inode moved with the same text (chmod, `cp -p` to a node's own disk)
    is read once, not by every later command, array task and worker: the cache trusts the current stat as
    planning does."""
    changes = index.stat_changes()
    if not changes:
        return None
    try:
        fresh, _ = load_or_build([f.path for f in index.inputs], progress=False)
    except (OSError, FastaError) as e:
        return f"{some(changes)}; it cannot be read now: {e}"
    try:
        return index.records_changed_in(fresh, changes)
    finally:
        fresh.close()
