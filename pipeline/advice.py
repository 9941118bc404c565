"""The `run_shards` commands that messages suggest, written so that a shell runs them as meant: every word
quoted where it needs it (an --out with a space, a quote or a `$` in it), plain words left as they are."""
from __future__ import annotations

import os
import shlex


def command(*words: str | os.PathLike | int) -> str:
    """`command("rerun", run.root)` -> "run_shards rerun /runs/out", or "run_shards rerun '/my runs/out'"."""
    return " ".join(["run_shards", *(shlex.quote(str(w)) for w in words)])
