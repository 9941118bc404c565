"""Linear layers whose every output row is the same bits however many rows are computed with it.

What holds where (float32; tests/test_batch_invariance.py checks it on the machine that runs it):
- Intel CPUs (AVX2 / AVX-512) run MKL in strict CNR mode (engine/mkl_cnr.py, set by each worker before
  its first op). Without it, on a 2-core Intel Xeon (AVX-512, AMX; MKL 2024.2) rows of a 1,024 -> 256
  product with 2 or 3 threads differed in the last bits from 1 thread's for every row count up to 100
  (agreeing at 333 and 600), and up to 14 rows even on 1 thread; 1,280 -> 5,120, 5,120 -> 1,280 and
  2,560 -> 2,560 likewise. In strict mode every row count from 1 to 600 agrees at 1-3 threads.
- AMD EPYC (2 cores, AVX-512, MKL 2024.2, MKL's default mode): rows differed between M = 1..3 rows and
  more (1..11 with 2 threads), and agreed for every M from 12 to 79 and sampled M up to 3,000 (1, 2, 3,
  4 and 8 threads for weights of 256 x 1,024 to 2,304 x 960; 1 to 3 threads down to 32 x 64). Whether
  MKL's strict mode applies there depends on the code branch MKL picks for the CPU (mkl_cnr.py).
Steps of few tokens (a decode step of a few sequences, a prefill's last few tokens alone in a step) would
otherwise give those tokens other bits than a full step does, so products of fewer than MIN_ROWS rows are
padded to MIN_ROWS: needed in MKL's default mode, harmless in strict mode, and it costs next to nothing.
bfloat16 and float16 products run through oneDNN, which has no such mode, so 16-bit runs on CPU are not
batch-invariant (engine/config.py).
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
