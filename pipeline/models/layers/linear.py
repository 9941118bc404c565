"""Linear layers whose every output row is the same bits however many rows are computed with it, where
MKL runs in its strict CNR mode.

What holds where (float32; tests/test_batch_invariance.py checks it on the machine that runs it):
- Intel CPUs (AVX2 / AVX-512) run MKL in strict CNR mode (engine/mkl_cnr.py, set by each worker before
  its first op and checked by computing). Without it, on a 2-core Intel Xeon (AVX-512, AMX; MKL 2024.2) rows
  of a 1,024 -> 256 product with 2 or 3 threads differed in the last bits from 1 thread's for every row
  count up to 100 (agreeing at 333 and 600), and up to 14 rows even on 1 thread; 1,280 -> 5,120, 5,120 ->
  1,280 and 2,560 -> 2,560 likewise. In strict mode every row count from 1 to 600 agrees at 1-3 threads.
- Nowhere else: MKL's other modes give a row other bits with the row count for some shapes and not others.
  On an AMD EPYC (MKL's default mode) rows agreed from 12 rows up for the weights sampled, yet a masked LM
  of hidden 32 stored other pseudo-log-likelihoods under another budget and thread count (issue 37). On
  the Xeon, MKL's default mode on its SSE4.2, AVX2 and COMPATIBLE branches (MKL_ENABLE_INSTRUCTIONS,
  MKL_CBWR) reproduces that: rows of 32 -> 96 and 32 -> 33 products change from 17 rows up, even on one
  thread, and that PLL path then differs between budgets; with each row computed alone it does not. So a
  run claims batch invariance only in strict mode (engine/mkl_cnr.py).
Products of fewer than MIN_ROWS rows are padded to MIN_ROWS: a decode step of a few sequences, a prefill's
last few tokens alone in a step then take the kernel path a full step takes (MKL's other modes take another
below about 12 rows); it costs next to nothing. bfloat16 and float16 products run through oneDNN, which has
no such mode, so 16-bit runs on CPU are not batch-invariant (engine/config.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a CPU product of fewer than MIN_ROWS rows (over x's leading dims) padded with zero rows."""
    rows = x.numel() // max(1, x.shape[-1])
    if x.device.type != "cpu" or rows >= MIN_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(MIN_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, -1)
    return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
