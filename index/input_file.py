"""One input FASTA file as the index records it: path, size, modification time, status-change time and inode
(and, for indexes of format 2, a whole-file checksum), to tell whether it changed since.

Why the change time and the inode as well: an edit that keeps the file's size, with its modification time
set back (`touch -r`, `rsync -t`, an editor that restores it), or another file of the same size and
modification time renamed into its place (`mv`, `cp -p` then `mv`), keeps both. Every write and every
rename moves the change time, which no user command can set back, and a file renamed into place has another
inode. Both come with the same stat call, so the check costs nothing more. (A change of mode or owner moves
it too: the index is then built again and found to describe the same records.) Indexes written before
these were recorded have None there, and are compared on what they recorded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class InputFile:
    path: str       # absolute path
    size: int
    mtime_ns: int
    content_crc32: int | None = None   # format 2's checksum of the whole file (None: not known)
    ctime_ns: int | None = None        # status-change time (None: an index written before it was recorded)
    inode: int | None = None           # (None: likewise)

    @property
    def state(self) -> tuple:
        """What a stat call shows: equal states mean the file was not touched since."""
        return self.path, self.size, self.mtime_ns, self.ctime_ns, self.inode

    def unchanged(self, now: "InputFile") -> bool:
        """Whether `now` (a stat of the same path) shows the file as it was recorded, on every field recorded."""
        return (self.path, self.size, self.mtime_ns) == (now.path, now.size, now.mtime_ns) \
            and self.ctime_ns in (None, now.ctime_ns) and self.inode in (None, now.inode)

    def change(self, now: "InputFile") -> str | None:
        """What moved between this record of the file and `now`, in words (None: nothing)."""
        if now.size != self.size:
            return f"size changed from {self.size} to {now.size} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "modified since it was indexed"
        if self.inode is not None and now.inode != self.inode:
            return ("replaced by another file since it was indexed (renamed into its place, with the same size and "
                    "modification time)")
        if self.ctime_ns is not None and now.ctime_ns != self.ctime_ns:
            return ("changed since it was indexed, though its size and modification time are as they were (written "
                    "with its modification time set back, or its permissions or owner changed)")
        return None

    @staticmethod
    def stat(path: str | os.PathLike, content_crc32: int | None = None) -> "InputFile":
        path = os.path.abspath(os.fspath(path))
        st = os.stat(path)
        return InputFile(path, st.st_size, st.st_mtime_ns, content_crc32, st.st_ctime_ns, st.st_ino)


# The change time and inode are kept in the index header beside "inputs", not in it: a run_shards from before
# them reads a newer index (a run directory, a shared cache) as it always did, comparing size and mtime.
_STATS = ("ctime_ns", "inode")


def to_header(inputs: list[InputFile]) -> dict:
    """The index header's fields that record `inputs` (`from_header` reads them back)."""
    return {"inputs": [{k: v for k, v in vars(f).items() if k not in _STATS} for f in inputs],
            "input_stats": [{k: getattr(f, k) for k in _STATS} for f in inputs]}


def from_header(header: dict) -> list[InputFile]:
    """The inputs an index header records (without change times and inodes where it predates them)."""
    stats = header.get("input_stats") or [{} for _ in header["inputs"]]
    return [InputFile(**f, **{k: v for k, v in extra.items() if k in _STATS})
            for f, extra in zip(header["inputs"], stats)]


def lasting_path(path: str | os.PathLike) -> str:
    """The absolute path of `path`, where a descriptor's path (/dev/stdin, /dev/fd/N, /proc/self/fd/N: a
    file on standard input) that leads to a file is replaced by that file's: the one later commands, workers
    and other nodes can open (each of them would open its own standard input). A pipe's is kept (refused
    when indexed: build.check_regular)."""
    path = os.path.abspath(os.fspath(path))
    if path == "/dev/stdin" or path.startswith(("/dev/fd/", "/proc/")):
        real = os.path.realpath(path)
        if real != path and not real.startswith(("/proc/", "/dev/")) and os.path.isfile(real):
            return real
    return path
