"""Linear layers whose every output row is the same bits however many rows are computed with it.

On CPU, MKL's sgemm takes another path for products of few rows: on the 2-core AMD EPYC this project
develops on (MKL 2024.2, AVX-512), row results of F.linear differ in the last bits between M = 1..3 rows
and more (1..11 with 2 threads), and agree for every M from 12 to 79 and sampled M up to 3,000 (1, 2, 3,
4 and 8 threads for weights of 256 x 1,024 to 2,304 x 960; 1 to 3 threads down to 32 x 64).
tests/test_batch_invariance.py checks this on the machine that runs it. Steps of few tokens (a decode
step of a few sequences, a prefill's last few tokens alone in a step) would otherwise give those tokens
other bits than a full step does. Padding such products to MIN_ROWS rows costs next to nothing.
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
