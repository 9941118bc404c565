"""RMS norms in the exact arithmetic of the transformers implementations we are compared against."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from triton_kernels import pointwise
from triton_kernels.rms_norm import add_rms_norm


def rms_normalise(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) [* weight]` over the last dim, in float32 (a new tensor).

    On GPU torch's fused rms_norm (one kernel). On CPU that kernel is the slow one: 2.1-2.8 ms on 2M
    float32 elements against 0.3 ms for a vector_norm over the same rows and 0.7 ms for layer_norm (1
    thread; bench/cpu_op_costs.py), so the scale is computed from vector_norm: 1.2-1.3 ms in all.
    """
    xf = x.float()
    if x.device.type != "cpu":
        return F.rms_norm(xf, (x.shape[-1],), weight, eps)
    scale = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    h = xf * scale if xf is x else xf.mul_(scale)   # a 16-bit x was copied to float32: scale the copy
    return h if weight is None else h.mul_(weight)


# On CPU, norms over many rows go a block of rows at a time: their float32 copy and its products stay in
# cache instead of making several passes through memory, and each block's result is cast as it is copied
# into the output. A bfloat16 norm of the 1/8 Qwen3.5's hidden state, 1 thread (bench/cpu_op_costs.py):
# 1.42 / 1.95 ms whole on 2,859 / 4,000 rows, 1.13 / 1.47 in blocks of 512 KiB; blocks of 128 KiB lose
# to per-call overhead (1.73 / 2.36), 2 MiB ones fall out of cache (1.30 / 1.74).
CPU_BLOCK_BYTES = 512 << 10


def cpu_row_blocks(x: torch.Tensor) -> list[slice] | None:
    """Row slices (over x's first dim) of about CPU_BLOCK_BYTES of float32 each, for a CPU tensor of more
    than one such block; None for one block, or on a GPU (normalise it whole)."""
    if x.device.type != "cpu" or x.dim() < 2:
        return None
    rows = max(1, CPU_BLOCK_BYTES // (4 * max(1, math.prod(x.shape[1:]))))
    return None if x.shape[0] <= rows else [slice(r0, r0 + rows) for r0 in range(0, x.shape[0], rows)]


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * w` in float32 (see rms_normalise).

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
        blocks = cpu_row_blocks(x)
        if blocks is None:
            return self._norm(x).to(x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for rows in blocks:
            out[rows] = self._norm(x[rows])
        return out

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """Zero-centred: float32, to be cast back; otherwise already in x's dtype."""
        if self.zero_centred:
            return rms_normalise(x, self.eps, 1.0 + self.weight.float())
        return self.weight * rms_normalise(x, self.eps).to(x.dtype)


def add_norm(x: torch.Tensor, y: torch.Tensor | None, norm: RMSNorm,
             out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, norm(x + y)) in one pass (triton_kernels.rms_norm.add_rms_norm; y None: (x, norm(x))), in the
    norm's own arithmetic: the fused layers of the Triton path. x, y `[T, d]`; the norm's output in out_dtype
    (default the sum's)."""
    return add_rms_norm(x, y, norm.weight, norm.eps, zero_centred=norm.zero_centred, out_dtype=out_dtype)


class GatedRMSNorm(nn.Module):
    """Qwen3.5's output norm of the delta-rule mixer: `w * rmsnorm(o) * silu(z)`, the weight used as is.

    Returns z's dtype (the model's). o may be float32 where z is 16-bit (the CPU delta rule's output is
    float32): it is normalised as it is, where transformers first rounds it to the model's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] of the same shape (gate may be a strided view). The weight is applied in
        float32 with the normalisation, where transformers applies it after rounding to the model's
        dtype: one rounding fewer for 16-bit models, and fewer casts and passes."""
        blocks = cpu_row_blocks(x)
        if blocks is None:
            return self._norm(x, gate).to(gate.dtype)
        out = torch.empty(x.shape, dtype=gate.dtype, device=x.device)
        for rows in blocks:
            out[rows] = self._norm(x[rows], gate[rows])
        return out

    def _norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """float32, to be cast back to gate's dtype."""
        h = rms_normalise(x, self.eps, self.weight.float())
        silu = pointwise.silu_(gate.float()) if gate.dtype != torch.float32 else pointwise.silu(gate)
        return h.mul_(silu)
