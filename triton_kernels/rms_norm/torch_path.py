"""The rms_norm kernels in plain torch: the unfused ops, with the rounding points of the kernels.

These are what CPU tensors run outside the interpreter. The engine's CPU path does not call them: its layers
keep pipeline/models/layers/norms.py and mlp.py (their bits), whose arithmetic these follow."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import pointwise


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim, in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def add_rms_norm_torch(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                       zero_centred: bool, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernel.add_rms_norm."""
    s = x if y is None else x + y
    dtype = out_dtype or s.dtype
    if zero_centred:
        return s, _rms(s, eps, 1.0 + weight.float()).to(dtype)
    return s, (weight * _rms(s, eps).to(dtype)).to(dtype)


def gated_rms_norm_torch(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See kernel.gated_rms_norm."""
    return (_rms(o, eps, weight.float()) * F.silu(z.float())).to(z.dtype)


def silu_mul_torch(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """See kernel.silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1) if torch.is_tensor(gate_up) else gate_up
    return F.silu(gate) * up


def gelu_tanh_mul_torch(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """See kernel.gelu_tanh_mul: T5FeedForward's unfused ops (pipeline/models/t5.py)."""
    gate, up = gate_up.chunk(2, dim=-1) if torch.is_tensor(gate_up) else gate_up
    return pointwise.gelu_tanh(gate).mul_(up)
