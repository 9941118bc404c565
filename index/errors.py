"""Errors for bad FASTA input: each names the file, the line and the record id, and says what to do."""
from __future__ import annotations

import os
import shlex


class FastaError(ValueError):
    """A problem with a user's FASTA file; the CLI prints it without a traceback."""

    def __init__(self, path: str | os.PathLike, message: str, *, line: int | None = None,
                 seq_id: str | None = None, hint: str | None = None):
        self.path = os.fspath(path)
        self.line = line
        self.seq_id = seq_id
        # Hints write commands on FILE: they name the file itself, so each can be run as it is printed.
        self.hint = hint.replace("FILE", shlex.quote(self.path)) if hint else hint
        where = self.path if line is None else f"{self.path}:{line}"
        text = f"{where}: {message}"
        if seq_id is not None:
            text += f" (record '{seq_id}')"
        if self.hint:
            text += f". {self.hint}"
        super().__init__(text)


class InputChanged(FastaError):
    """A FASTA file no longer holds a record where its index says it is: it changed after indexing."""


def line_number(path: str | os.PathLike, offset: int) -> int:
    """1-based line number of byte `offset` in `path`, lines ending at LF, CRLF or a lone CR (only used to
    word error messages)."""
    from .source import open_stream   # (source.py reports errors of its own through this module)
    count, previous = 0, b""
    with open_stream(path) as fh:
        remaining = offset
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if previous == b"\r" and chunk[:1] == b"\n":   # a CRLF split between two reads
                count -= 1
            previous = chunk[-1:]
            remaining -= len(chunk)
    return count + 1
