"""Errors for bad FASTA input: each names the file, the line and the record id, and says what to do."""
from __future__ import annotations

import os
import re
import shlex


class FastaError(ValueError):
    """A problem with a user's FASTA file; the CLI prints it without a traceback."""

    def __init__(self, path: str | os.PathLike, message: str, *, line: int | None = None,
                 seq_id: str | None = None, hint: str | None = None, text: str | os.PathLike | None = None):
        self.path = os.fspath(path)
        self.line = line
        self.seq_id = seq_id
        self.message, self.hint_template = message, hint
        # Hints write commands on FILE, the file itself, or on TEXT, its text as a plain file (`text`; the file
        # itself unless it is compressed): they name the files, so each can be run as it is printed.
        names = {"FILE": shlex.quote(self.path), "TEXT": shlex.quote(os.fspath(text or path))}
        self.hint = re.sub("FILE|TEXT", lambda m: names[m.group()], hint) if hint else hint
        where = self.path if line is None else f"{self.path}:{line}"
        said = f"{where}: {message}"
        if seq_id is not None:
            said += f" (record '{seq_id}')"
        if self.hint:
            said += f". {self.hint}"
        super().__init__(said)

    def in_text_of(self, source: str | os.PathLike) -> "FastaError":
        """This error, found in the text of `source`, a compressed file that the user gave (gzip, read through
        its decompressed copy, or BGZF, read in place): it names `source`, at the same line, and a hint's
        command on TEXT runs on a plain copy that the hint says how to make."""
        source = os.fspath(source)
        hint = self.hint_template
        if hint and "TEXT" in hint:
            hint += " (first decompress it: gzip -dc FILE > TEXT)"
        return type(self)(source, self.message, line=self.line, seq_id=self.seq_id, hint=hint,
                          text=source[:-3] if source.endswith(".gz") else source + ".fasta")


class InputChanged(FastaError):
    """A FASTA file no longer holds a record where its index says it is: it changed after indexing."""
