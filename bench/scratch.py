"""A benchmark's scratch folder (its checkpoints and FASTA): a temporary folder removed when the script exits,
however it exits short of a kill. A GPU benchmark's checkpoints take gigabytes (ESM-2 3B: ~6 GB in bfloat16):
left behind in /tmp, a few runs fill a lent machine's disk."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_folder(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
