"""The `run_shards` commands that messages suggest, written so that a shell runs them as meant: every word
quoted where it needs it (an --out with a space, a quote or a `$` in it), plain words left as they are."""
from __future__ import annotations

import contextlib
import contextvars
import os
import shlex

# Set while a --dry-run command runs: the `run` and `rerun` commands it suggests (a start over in another --out,
# the continuation of a run planned by an earlier version) are previews too, not submissions the user never asked
# for. Only a SLURM run has --dry-run, and both commands take it there.
_PREVIEW = contextvars.ContextVar("preview", default=False)


def command(*words: str | os.PathLike | int) -> str:
    """`command("rerun", run.root)` -> "run_shards rerun /runs/out", or "run_shards rerun '/my runs/out'"."""
    words = [w if isinstance(w, _Glob) else str(w) for w in words]
    if _PREVIEW.get() and words[:1] in (["run"], ["rerun"]) and "--dry-run" not in words:
        words.append("--dry-run")
    return " ".join(["run_shards", *(w if isinstance(w, _Glob) else shlex.quote(w) for w in words)])


@contextlib.contextmanager
def previewing(dry_run: bool):
    """Within: a --dry-run command's suggested `run` / `rerun` commands keep --dry-run (when `dry_run`; False
    turns it off inside, for what outlives the command, as report.html)."""
    token = _PREVIEW.set(bool(dry_run))
    try:
        yield
    finally:
        _PREVIEW.reset(token)


# Above this many FASTA files, a line names a few of them and how many there are, and a suggested command names
# them by a glob where one names exactly them (in their order): 3,000 input files made a 150 KB first line in
# run.log and 100 KB commands in messages.
MANY_FILES = 8


class _Glob(str):
    """A command word already written for the shell (its literal parts quoted): `command` keeps it as it is."""


def files_shown(paths: list[str | os.PathLike]) -> str:
    """`a.fasta b.fasta`, or, for many, `3,000 files: dir/p00000.fasta dir/p00001.fasta ... dir/p02999.fasta`."""
    paths = [os.fspath(p) for p in paths]
    if len(paths) <= MANY_FILES:
        return " ".join(paths)
    return f"{len(paths):,} files: {paths[0]} {paths[1]} ... {paths[-1]}"


def files_words(paths: list[str | os.PathLike]) -> list[str]:
    """The words that name `paths` on a suggested command line, in their order: the paths, or, for many files
    of one directory, a glob that the shell expands to exactly them in that order (checked against the directory
    now, and only for names that sort the same in every locale: equal-length differing parts of digits and
    letters of one case, as zero-padded numbers are), else the paths."""
    paths = [os.fspath(p) for p in paths]
    glob = _glob_of(paths) if len(paths) > MANY_FILES else None
    return [glob] if glob else paths


def _glob_of(paths: list[str]) -> "_Glob | None":
    import glob
    import re
    folders = {os.path.dirname(p) for p in paths}
    names = [os.path.basename(p) for p in paths]
    if len(folders) != 1 or len(set(names)) != len(names) or any(not n or n.startswith(".") for n in names):
        return None
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    middles = [n[len(prefix):len(n) - len(suffix)] for n in names]
    if len({len(m) for m in middles}) != 1 or not all(re.fullmatch(r"[0-9a-z]+|[0-9A-Z]+", m) for m in middles) \
            or middles != sorted(middles):
        return None
    folder = folders.pop()
    pattern = os.path.join(glob.escape(folder), glob.escape(prefix)) + "*" + glob.escape(suffix)
    if sorted(glob.glob(pattern)) != paths:
        return None
    head = os.path.join(folder, prefix)
    return _Glob((shlex.quote(head) if head else "") + "*" + (shlex.quote(suffix) if suffix else ""))
