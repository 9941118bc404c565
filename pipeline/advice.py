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
    words = [str(w) for w in words]
    if _PREVIEW.get() and words[:1] in (["run"], ["rerun"]) and "--dry-run" not in words:
        words.append("--dry-run")
    return " ".join(["run_shards", *(shlex.quote(w) for w in words)])


@contextlib.contextmanager
def previewing(dry_run: bool):
    """Within: a --dry-run command's suggested `run` / `rerun` commands keep --dry-run (when `dry_run`; False
    turns it off inside, for what outlives the command, as report.html)."""
    token = _PREVIEW.set(bool(dry_run))
    try:
        yield
    finally:
        _PREVIEW.reset(token)
