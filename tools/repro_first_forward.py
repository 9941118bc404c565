"""Reproducer (fixed 2026-11-26 in triton_kernels/pointwise.py: cos and sin on one thread): with 2 torch threads the native engine's FIRST forward of a batch gives
different bits from every later forward of the same batch (tiny ESM-2, rows of the third sequence on, from the
first attention layer's output); with 1 thread all forwards agree. It is what makes the suite's byte-identity
tests (test_batch_invariance ...[esm-esm], test_continue ...contradict...) fail now and then: a worker that
ran 2 threads computed its first batch differently. The cause: aten's float32 cos (the rotary table): with 2 threads
its first call in a process gave other bits for the table's upper half than later calls (where inside aten
is not pinned down). Prints nothing now.

    PYTHONPATH=. python tools/repro_first_forward.py [iterations] [threads] [esm_checkpoint]

Seen with the suite's tiny ESM fixture (tests/conftest.py `models["esm"]`, loaded from disk in a fresh
process); with a checkpoint this script builds itself in-process it did not show in one try.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pipeline.worker.cpu_setup import set_cpu_threads, set_strict_matmuls

set_strict_matmuls()
set_cpu_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from pipeline.engine.native import NativeEngine  # noqa: E402
from tests.tiny_checkpoints import random_sequences  # noqa: E402
from tests.tiny_models import save_esm  # noqa: E402

model = sys.argv[3] if len(sys.argv) > 3 else save_esm(Path(tempfile.mkdtemp()) / "esm")
engine = NativeEngine.load(str(model), torch.device("cpu"), torch.float32, "", max_tokens_per_step=4096, max_seqs=256)
batch = random_sequences([298, 298, 298, 150, 60, 298, 298], seed=3)
first = None
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    out = engine.forward(batch, [0, 1, 2], False)
    now = [out.hidden[k].numpy().copy() for k in (0, 1, 2)]
    if first is None:
        first = now
        continue
    for k, (a, b) in enumerate(zip(first, now)):
        rows = np.flatnonzero((a != b).any(1))
        if len(rows):
            print(f"forward {it}: layer {k} differs from the first forward at {len(rows)} rows, from row {rows[0]}")
