"""`linear_gelu` in plain torch: F.linear, then the erf GELU, each rounded to the tensors' dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_gelu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="none")
