"""What a run claims about batch invariance rests on MKL's strict CNR mode, checked by computing
(pipeline/engine/mkl_cnr.py): the check finds MKL's other modes, a CPU whose MKL branch strict mode does not
cover is not claimed invariant (issue 37: an AMD EPYC was, and its pseudo-log-likelihoods changed with the
budget), and a worker refuses a claim its own CPU cannot keep. Each case runs in a fresh process: MKL takes
its mode before it first computes, once per process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pipeline.engine import mkl_cnr

from .tiny_models import REPO


def _python(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(full, PYTHONPATH=str(REPO), **env))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_check_names_a_product_whose_rows_follow_the_row_count():
    """A product whose rows take other bits at 20 to 99 rows (as MKL's default mode does at some counts) is
    found, with where; one whose rows never do is not."""
    def row_by_row(x, w):   # each row alone: the same call whatever the row count (on every CPU and MKL mode)
        return torch.cat([F.linear(x[i:i + 1], w) for i in range(len(x))])

    def drifting(x, w):
        out = row_by_row(x, w)
        return out * (1 + 2 ** -20) if 20 <= len(x) < 100 else out

    assert mkl_cnr.rows_differ((1,), ((32, 33),), drifting) == "32 -> 33 features, 20 rows, 1 thread(s)"
    assert mkl_cnr.rows_differ((1, 2), ((32, 33),), row_by_row) is None


@pytest.mark.skipif(not mkl_cnr.strict_supported(), reason="MKL's strict mode does not apply to this CPU")
def test_strict_mode_passes_the_check_and_mkls_default_mode_does_not():
    """On this CPU MKL's default mode gives some product rows other bits with the row or thread count, and
    the check finds it; in strict mode every row agrees and the run may claim the property."""
    code = ("from pipeline.engine import mkl_cnr\n"
            "print(mkl_cnr.rows_differ(mkl_cnr.CHECK_THREADS))\n")
    assert _python(code).strip() != "None"
    code = ("from pipeline.engine import mkl_cnr\n"
            "mode = mkl_cnr.strict_matmuls()\n"
            "print(mode.holds, mkl_cnr.rows_differ(mkl_cnr.CHECK_THREADS))\n")
    assert _python(code).split() == ["True", "None"]


EMULATED = """
import torch
from pipeline.engine import mkl_cnr
from pipeline.engine.config import batch_invariance_holds
from pipeline.errors import UserError
from pipeline.worker.cpu_setup import set_strict_matmuls
mode = set_strict_matmuls()
print("holds:", mode.holds, mkl_cnr.strict_matmuls().holds, batch_invariance_holds(4096, True, torch.float32))
print("text:", mode.text)
try:
    set_strict_matmuls(run_dir="OUT")
except UserError as e:
    print("refused:", e)
"""


def test_a_cpu_whose_mkl_branch_strict_mode_does_not_cover_is_not_claimed_batch_invariant():
    """MKL_ENABLE_INSTRUCTIONS=SSE4_2 runs MKL's SSE4.2 branch, which strict mode does not cover, in its default
    mode, as an AMD EPYC's MKL does: not claimed (it was, before issue 37), said why, and a worker of a run whose
    result claims it refuses."""
    out = _python(EMULATED, MKL_ENABLE_INSTRUCTIONS="SSE4_2")
    assert "holds: False False False" in out
    assert "text: MKL in its default mode: its strict CNR mode does not apply to this CPU's code branch" in out
    assert "refused: this worker cannot compute the run's rows batch-invariant" in out and "rerun OUT" in out


def test_a_worker_checks_the_mode_after_its_threads_are_set_up():
    """check_strict_matmuls computes on 1 to 3 threads, so a worker calls it after set_cpu_threads (as
    shard_run does): the threads it starts then flush denormals as the worker's own do. It answers as
    strict_matmuls."""
    code = ("import torch\n"
            "from pipeline.worker.cpu_setup import check_strict_matmuls, set_cpu_threads, set_strict_matmuls\n"
            "from pipeline.engine import mkl_cnr\n"
            "set_strict_matmuls()\n"
            "flushing = set_cpu_threads(2)\n"
            "mode = check_strict_matmuls()\n"
            "torch.set_num_threads(3)\n"
            "probe = torch.full((3 << 16,), 1e-30)\n"
            "print(flushing, bool(((probe * 1e-10) == 0).all()), mode == mkl_cnr.strict_matmuls())\n")
    flushing, every_thread, same = _python(code).split()
    assert same == "True" and flushing == every_thread == "True"   # (x86 flushes denormals)
