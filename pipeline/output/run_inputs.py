"""The files a run reads, which no output option may name: its FASTA files, its variants file, its model's
files, and the run directory's own files (the result `get` and `export` read included). `--variants-out`,
`get -o` and `export -o` are refused before any work when they name one, or a place no file can be written
(a directory, a folder that does not exist or is not writable), saying which option and file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..rundir.layout import RunDir


@dataclass(frozen=True)
class ReadFile:
    """A file (or, `folder`, every file in a folder; `run`, the run directory's own files) a run reads."""
    what: str   # what a path it covers is, in words ("is the input FASTA")
    path: Path
    folder: bool = False
    run: bool = False

    def covers(self, target: Path) -> bool:
        if self.run:
            return RunDir(self.path).owns(target)
        if self.folder:
            return target.parent == _real(self.path)
        return target == _real(self.path)


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def of_run(out: str | os.PathLike | None, fasta: list[str], variants: str | None,
           model_path: str | None) -> list[ReadFile]:
    """What a run in `out` reads: its FASTA files, its --variants file, the files of its model checkpoint
    (`model_path`: a local directory, None for none), the run directory's own files (`out` None: none)."""
    found = [ReadFile("is the input FASTA", Path(f)) for f in fasta]
    if variants:
        found.append(ReadFile("is the --variants file", Path(variants)))
    if model_path:
        found.append(ReadFile("lies in the model checkpoint's folder, whose every file is part of the model",
                              Path(model_path), folder=True))
    if out is not None:
        found.append(ReadFile("is one of the run directory's own files", Path(out), run=True))
    return found


def of_result(result: Path) -> list[ReadFile]:
    """What the result at `result` was computed from, as its attributes (and the manifest of its run
    directory, when it lies in one) record it, with the result itself."""
    from .h5io import CorruptFile, Reader
    found = [ReadFile("is the result it reads", result)]
    try:
        with Reader(result) as r:
            attrs = r.attrs
    except (OSError, CorruptFile):
        return found   # (the command itself says what is wrong with the file)
    config = _json(attrs.get("config"))
    model = _json(attrs.get("resolved")).get("model")
    manifest = _json(_text(result.parent / "manifest.json"))
    if manifest:
        model = manifest.get("model", {}).get("path", model)
    return found + of_run(result.parent if manifest else None, _json(attrs.get("fasta_files")) or [],
                          config.get("variants"), model if model and model != "demo" else None)


def _json(text) -> dict | list:
    try:
        return json.loads(text) if isinstance(text, str) else (text or {})
    except ValueError:
        return {}


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def refuse_if_read(option: str, target: str | os.PathLike, files: list[ReadFile]) -> None:
    """UserError naming `option` and the file when `target` is one of `files` (or one of their links)."""
    where = _real(target)
    for f in files:
        if f.covers(where):
            shown = f"{target} ({where})" if str(where) != str(target) else str(target)
            raise UserError(f"{option} {shown} {f.what}: writing there would change what the run reads. Give "
                            "another file name; nothing was written.")


def check_output_file(option: str, target: str | os.PathLike, files: list[ReadFile]) -> None:
    """UserError, before any work, when `target` is one of `files` (refuse_if_read), a directory, or in a folder
    that does not exist or is not writable here."""
    refuse_if_read(option, target, files)
    path = _real(target)   # (a link is written where it points: rundir.layout.atomic_path)
    if path.is_dir():
        raise UserError(f"{option} {target}: is a directory; give a file name in it")
    if not path.parent.is_dir():
        raise UserError(f"{option} {target}: the directory {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"{option} {target}: the directory {path.parent} is not writable")
