"""`add_layer_norm` in plain torch: the residual add in the tensors' dtype, then F.layer_norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_layer_norm_torch(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernel.add_layer_norm."""
    s = x if y is None else x + y
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
