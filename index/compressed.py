"""Compressed FASTA. BGZF (what `bgzip` writes) is read in place through its block table (bgzf.py). Plain
gzip is decompressed once, streaming, into the cache, and the decompressed copy is what the index describes
and workers read by offset. The copy is reused while the .gz keeps its size, modification and change times
and inode (a sidecar records them; input_file.py says why all four), and made again when it changes.

Why a copy for plain gzip rather than seek points into it: a seek point holds 32 KiB of inflate state and
each read inflates from the nearest one, so workers reading records in length order (all over the file)
would inflate far more than the file; a copy keeps every reader as simple and fast as for a plain file,
costs one streaming pass (about the time of `gzip -dc`), and needs the decompressed size on the cache's
disk, which is checked as it is written. `bgzip` is the way to skip the copy. Other compressions are
refused by name, with the command that converts them.

Copies live in `$RUN_SHARDS_CACHE/decompressed/` (see cache.py); for a cluster run, the cache must be on
storage every node sees (it is under the home directory by default).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Sequence

from .bgzf import NotBgzf, block_table, looks_like_bgzf
from .errors import FastaError

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"
# Magic bytes of compressions we do not read, with the command that turns them into gzip.
# (The plain alternatives write FILE.fasta: `xz -dk` and `zstd -d` skip a file without their suffix, and
# `bunzip2 -k` names it FILE.out.)
OTHER_COMPRESSIONS = {
    b"\xfd7zXZ\x00": ("xz", "xz -dc FILE | bgzip > FILE.fasta.gz   (or: xz -dc FILE > FILE.fasta)"),
    b"\x28\xb5\x2f\xfd": ("zstd", "zstd -dc FILE | bgzip > FILE.fasta.gz   (or: zstd -dc FILE > FILE.fasta)"),
    b"BZh": ("bzip2", "bzip2 -dc FILE | bgzip > FILE.fasta.gz   (or: bzip2 -dc FILE > FILE.fasta)"),
}
CHUNK = 1 << 22


def kind(path: str | os.PathLike) -> str | None:
    """'bgzf', 'gzip' (another gzip file), None for an uncompressed file; FastaError for a compression we
    do not read."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 10)
    except OSError:
        return None   # the scanner names unreadable files
    if head[:2] == GZIP_MAGIC:
        return "bgzf" if looks_like_bgzf(head) else "gzip"
    for magic, (name, command) in OTHER_COMPRESSIONS.items():
        if head.startswith(magic):
            raise FastaError(str(path), f"file is {name}-compressed, which run_shards does not read",
                             hint=f"Convert it to BGZF (bgzip, from htslib; read in place), gzip or plain text: "
                                  f"{command}")
    return None


def readable_paths(paths: Sequence[str | os.PathLike], cache: Path, progress: bool = True) -> list[str]:
    """The paths to index: BGZF and plain files as they are, each other gzip file replaced by its (made or
    reused) decompressed copy."""
    return [copy_of(p, cache, progress) if _needs_copy(p) else os.fspath(p) for p in paths]


def _needs_copy(path: str | os.PathLike) -> bool:
    found = kind(path)
    if found == "bgzf":
        try:
            table = block_table(os.fspath(path))   # every member BGZF (kept for the scan that follows)
            log.info("%s: BGZF, read in place through its %s blocks", path, f"{len(table) - 1:,}")
            return False
        except NotBgzf as e:               # e.g. a plain gzip member appended to a bgzip file
            log.info("%s; reading the file through a decompressed copy", e)
            return True
    return found == "gzip"


def _stat_key(path: str | os.PathLike) -> dict:
    st = os.stat(path)
    return {"source": os.path.abspath(os.fspath(path)), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _source_changed(key: dict) -> bool:
    """Whether the .gz a sidecar `key` describes changed since, on every field the sidecar recorded (one written
    before the change time and inode were recorded has neither: a run planned then is not refused for that)."""
    now = _stat_key(key["source"])
    return any(key[k] != now[k] for k in now if k in key)


def copy_path(path: str | os.PathLike, cache: Path) -> Path:
    digest = hashlib.sha1(os.path.abspath(os.fspath(path)).encode()).hexdigest()[:20]
    name = Path(os.fspath(path)).name
    stem = name[:-3] if name.endswith(".gz") else name
    return cache / "decompressed" / f"{digest}-{stem}"


def copy_is_current(path: str | os.PathLike, cache: Path) -> bool:
    """Whether the decompressed copy of `path` was made from the file as it is now."""
    target = copy_path(path, cache)
    try:
        return json.loads(target.with_name(target.name + ".json").read_text()) == _stat_key(path) \
            and target.exists()
    except (OSError, ValueError):
        return False


def given_path(indexed: str) -> str:
    """The file the user gave for an indexed path: the .gz whose decompressed copy it is (its sidecar names
    it), else the path itself. Messages name this one."""
    if Path(indexed).parent.name != "decompressed":
        return indexed   # a plain or BGZF file, read where it is
    try:
        return json.loads(Path(indexed + ".json").read_text())["source"]
    except (OSError, ValueError, KeyError):
        return indexed


def source_changes(indexed: Sequence[str]) -> list[str]:
    """For indexed paths that are decompressed copies: the .gz files that changed since (or are gone)."""
    changes = []
    for copy in indexed:
        try:
            key = json.loads(Path(copy + ".json").read_text())
        except (OSError, ValueError):
            continue   # a plain file, not a copy
        try:
            if _source_changed(key):
                changes.append(f"{key['source']} changed since it was decompressed")
        except OSError:
            changes.append(f"{key['source']} is gone")
    return changes


def refresh(indexed: Sequence[str], progress: bool = True) -> None:
    """Make again the decompressed copies among `indexed` whose .gz changed (restored, or edited), so that
    comparing the copy with the index tells whether the records are still the same."""
    for copy in indexed:
        try:
            key = json.loads(Path(copy + ".json").read_text())
            if os.path.exists(key["source"]) and _source_changed(key):
                copy_of(key["source"], Path(copy).parent.parent, progress)
        except (OSError, ValueError, KeyError) as e:   # no usable key: the copy is checked as it is
            log.debug("not refreshing %s (%s: %s)", copy, type(e).__name__, e)
            continue


def _unwritable(path: str | os.PathLike, folder: Path, e: OSError) -> FastaError:
    """The refusal when the cache cannot hold a decompressed copy (a read-only cache, one of another user)."""
    return FastaError(str(path), f"cannot write its decompressed copy into {folder} ({e.strerror or e}): a gzip "
                      "file is read through a decompressed copy in run_shards' cache",
                      hint="Point RUN_SHARDS_CACHE at a folder you can write, or give the FASTA decompressed (or "
                           "as a BGZF file, which is read in place: `bgzip`, from htslib): gzip -dc FILE > FILE.fasta")


# A copy being written is locked by its writer (flock: released when it dies, even by kill -9). One found
# unlocked and untouched this long was left by a killed command (as large as the FASTA): the next copy removes it.
ABANDONED_AFTER_S = 60.0


def _hold(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:   # a file system without locks: such a copy is never taken for abandoned
        log.debug("could not lock the decompressed copy being written: %s", e)


def _remove_abandoned_copies(target: Path) -> None:
    """Remove the half-written copies of `target` whose writers died (unlocked, untouched for a minute): a
    command killed while decompressing left one, which nothing else would ever remove."""
    for path in target.parent.glob(f".{target.name}.tmp*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue   # (removed meanwhile)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # free: its writer is gone (or has just started)
            if time.time() - os.fstat(fd).st_mtime > ABANDONED_AFTER_S:
                path.unlink(missing_ok=True)
                log.info("removed %s, a decompressed copy left half-written by a killed command", path)
        except OSError:
            pass   # being written now, or no locks on this file system: left alone
        finally:
            os.close(fd)


def copy_of(path: str | os.PathLike, cache: Path, progress: bool = True) -> str:
    """The decompressed copy of gzip file `path`, made now unless a current one exists."""
    target = copy_path(path, cache)
    if copy_is_current(path, cache):
        log.info("%s: reusing its decompressed copy %s", path, target)
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(path, target.parent, e) from None
    key = _stat_key(path)
    _remove_abandoned_copies(target)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    size = key["size"]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"decompressing {Path(os.fspath(path)).name}",
                   leave=False, disable=None)
    written = 0
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            _hold(dst.fileno())
            d, open_member = zlib.decompressobj(zlib.MAX_WBITS | 16), False
            while chunk := src.read(CHUNK):
                if bar:
                    bar.update(len(chunk))
                while chunk:
                    if not open_member and not chunk.strip(b"\0"):
                        break                      # zero padding after the last member, as gzip allows
                    out = d.decompress(chunk)
                    dst.write(out)
                    written += len(out)
                    open_member = True
                    if d.eof:                      # the next member (BGZF is a series of gzip members)
                        chunk, d, open_member = d.unused_data, zlib.decompressobj(zlib.MAX_WBITS | 16), False
                    else:
                        chunk = b""
            if open_member:
                raise FastaError(str(path), "the gzip data ends early (the file is truncated)",
                                 hint="Download or copy the file again (gzip -t FILE checks it)")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, target)
        target.with_name(target.name + ".json").write_text(json.dumps(key))
    except FastaError:
        tmp.unlink(missing_ok=True)
        raise
    except zlib.error as e:
        tmp.unlink(missing_ok=True)
        raise FastaError(str(path), f"the gzip data is damaged ({e})",
                         hint="Download or copy the file again (gzip -t FILE checks it)") from None
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise FastaError(str(path), f"no space to decompress it into {target.parent} ({written:,} bytes "
                             f"written when the disk filled)",
                             hint="Free space there, or point RUN_SHARDS_CACHE at a larger disk") from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _unwritable(path, target.parent, e) from None
        raise
    finally:
        if bar:
            bar.close()
    log.info("%s: decompressed into %s (%s bytes)", path, target, f"{written:,}")
    return str(target)

