"""One input FASTA file as the index records it: path, size and modification time (and, for indexes of
format 2, a whole-file checksum), to tell whether it changed since."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class InputFile:
    path: str       # absolute path
    size: int
    mtime_ns: int
    content_crc32: int | None = None   # format 2's checksum of the whole file (None: not known)

    @property
    def state(self) -> tuple[str, int, int]:
        """What a stat call shows: equal states mean the file was not touched since."""
        return self.path, self.size, self.mtime_ns

    @staticmethod
    def stat(path: str | os.PathLike, content_crc32: int | None = None) -> "InputFile":
        path = os.path.abspath(os.fspath(path))
        st = os.stat(path)
        return InputFile(path, st.st_size, st.st_mtime_ns, content_crc32)
