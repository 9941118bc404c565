"""The digest of a file's whole content (a checkpoint's weights), kept between commands so it is read once.

A run records its checkpoint by content, so that a continued run, `rerun`, `--reuse` and each worker (before
and after its load, a SLURM task perhaps days later) can tell that the weights are the ones the run planned
with. A digest of each file's size and first MiB (run_shards before 2026-12-07) missed an in-place save that
kept the size: top layers fine-tuned and saved over the checkpoint changed no byte of the first MiB, and a
continued run merged rows of both models into one result.

Reading a 1.3 GB checkpoint whole costs about a second on one core, so the digest is kept in
`$RUN_SHARDS_CACHE/digests`, under a key of the file's real path and what the file system says of it: size,
inode, and modification and change times to the nanosecond. Any write to the file sets its change time
(ctime), which no program can set back (`touch -d` sets the modification time, and changes the ctime too), so
a changed file is read again. A file is read in PIECE pieces by a pool of threads (hashlib releases the GIL):
its digest is the sha256 of its pieces' sha256 digests, in order.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

PIECE = 16 << 20
THREADS = 8
ANNOUNCED = 1 << 30   # a file larger than this is announced before it is read (seconds, on a slow disk minutes)
_HEX = re.compile(r"[0-9a-f]{64}")


def digest(path: str | os.PathLike, cache: Path | None) -> str:
    """sha256 (64 hex digits) of the pieces' digests of the file at `path`, from `cache` (a folder; None:
    not kept) where a digest of the file as it is now was kept, else read and kept there."""
    real = os.path.realpath(path)
    before = os.stat(real)
    kept = None if cache is None else cache / _key(real, before)
    if kept is not None:
        try:
            found = kept.read_text().strip()
            if _HEX.fullmatch(found):
                return found
        except OSError:
            pass
    if before.st_size > ANNOUNCED:
        log.info("reading %s (%.1f GB) whole for its digest, once: later commands find it kept", path,
                 before.st_size / 1e9)
    began = time.monotonic()
    value = _read(real, before.st_size)
    seconds = time.monotonic() - began
    if seconds > 1:
        log.info("read %s whole for its digest: %.2f GB in %.1f s", path, before.st_size / 1e9, seconds)
    if kept is not None and _key(real, os.stat(real)) == kept.name:   # (not kept for a file written meanwhile)
        _keep(kept, value)
    return value


def _key(real: str, st: os.stat_result) -> str:
    what = f"{real}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    return hashlib.sha256(what.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _read(real: str, size: int) -> str:
    fd = os.open(real, os.O_RDONLY)
    try:
        def piece(offset: int) -> bytes:
            h = hashlib.sha256()
            done = 0
            while done < min(PIECE, size - offset):
                data = os.pread(fd, min(PIECE, size - offset) - done, offset + done)
                if not data:   # (the file shrank while read: its digest differs from any kept)
                    break
                h.update(data)
                done += len(data)
            return h.digest()
        offsets = range(0, size, PIECE)
        if len(offsets) <= 1:
            pieces = [piece(o) for o in offsets]
        else:
            with ThreadPoolExecutor(min(THREADS, len(offsets), os.cpu_count() or 1)) as pool:
                pieces = list(pool.map(piece, offsets))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(pieces)).hexdigest()


def _keep(kept: Path, value: str) -> None:
    """Written under a temporary name and renamed into place: a reader sees a whole digest or none. A cache that
    cannot be written only costs the next command the read."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
        tmp.write_text(value + "\n")
        os.replace(tmp, kept)
    except OSError as e:
        log.debug("digest not kept in %s: %s", kept.parent, e)
