"""RMS norms in the exact arithmetic of the transformers implementations we are compared against."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * w` in float32 (torch's fused rms_norm: one kernel, same formula).

    zero_centred (Qwen3.5): the weight is stored as w - 1, so the scale is (1 + w), applied in float32
    before the cast back. Otherwise (Llama, Qwen3) the normalised value is cast back to the input dtype
    first and then scaled, as transformers does; the two orders differ only in 16-bit dtypes.
    """

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, (x.shape[-1],)
        if self.zero_centred:
            return F.rms_norm(x.float(), shape, 1.0 + self.weight.float(), self.eps).to(dtype)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(dtype)


class GatedRMSNorm(nn.Module):
    """Qwen3.5's output norm of the delta-rule mixer: `w * rmsnorm(o) * silu(z)`, the weight used as is."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)
