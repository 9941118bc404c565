"""The public ops `add_rms_norm`, `gated_rms_norm`, `silu_mul` and `gelu_tanh_mul`: their checks, then the Triton
kernels (kernel.py, imported only on that path, so a CPU-only install never imports triton) or the torch paths."""
from __future__ import annotations

import torch

from .._device import kernels, knobs_for, use_triton
from ..launch_config import RmsNormKnobs
from .torch_path import add_rms_norm_torch, gated_rms_norm_torch, gelu_tanh_mul_torch, silu_mul_torch


def rms_norm_knobs(device: torch.device, **given: int | None) -> RmsNormKnobs:
    """The kernels' launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "rms", **given)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, *, zero_centred: bool,
                 out_dtype: torch.dtype | None = None, num_warps: int | None = None,
                 block_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + y (or x itself when y is None), `[T, d]`.

    x, y `[T, d]` (any row stride, contiguous channels), weight `[d]`. The sum is rounded to its dtype before it
    is normalised, as an unfused add stores it: x's, or as torch promotes (a float16 x plus a float32 y is float32);
    mean square in float32. zero_centred: h = s / rms * (1 + w) in float32, one rounding; else h = w * (s / rms
    rounded to the dtype), rounded again (as pipeline/models/layers/norms.py RMSNorm). h is in out_dtype (default
    the sum's: T5's norms of a float32 residual stream in a float16 model give the weight's, T5LayerNorm's cast).
    Tensors on CPU run add_rms_norm_torch unless TRITON_INTERPRET=1. Launch knobs (Triton only; None: the launch
    table's row for the tensors' GPU)."""
    if x.dim() != 2 or x.stride(1) != 1 or (y is not None and (y.shape != x.shape or y.stride(1) != 1)):
        raise ValueError(f"x and y must be [T, d] with contiguous channels, got {tuple(x.shape)} and "
                         f"{None if y is None else tuple(y.shape)}")
    if not use_triton(x):
        return add_rms_norm_torch(x, y, weight, eps, zero_centred=zero_centred, out_dtype=out_dtype)
    knobs = rms_norm_knobs(x.device, num_warps=num_warps, block_elements=block_elements)
    return kernels("rms_norm.kernel").add_rms_norm_triton(x, y, weight, eps, zero_centred, out_dtype, knobs)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   num_warps: int | None = None, block_elements: int | None = None) -> torch.Tensor:
    """`rmsnorm(o) * w * silu(z)` over the last dim, all in float32, rounded once to z's dtype (a new contiguous
    tensor of o's shape), as pipeline/models/layers/norms.py GatedRMSNorm (the weight applied in float32 with the
    normalisation).

    o, z `[T, H, V]` or `[T, V]` of the same shape, any token and head strides (views of the projection and of
    the delta rule's output), contiguous channels; weight `[V]`."""
    if o.shape != z.shape or o.dim() not in (2, 3) or o.stride(-1) != 1 or z.stride(-1) != 1:
        raise ValueError(f"o and z must be [T, H, V] or [T, V] of one shape with contiguous channels, got "
                         f"{tuple(o.shape)} and {tuple(z.shape)}")
    if not use_triton(o):
        return gated_rms_norm_torch(o, z, weight, eps)
    knobs = rms_norm_knobs(o.device, num_warps=num_warps, block_elements=block_elements)
    return kernels("rms_norm.kernel").gated_rms_norm_triton(o, z, weight, eps, knobs)


def _gate_and_up(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.chunk(2, dim=-1) if torch.is_tensor(gate_up) else gate_up
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gate and up must be [T, I] of one shape with contiguous columns, got "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    return gate, up


def _act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, block_rows: int | None, block_cols: int | None,
             num_warps: int | None) -> torch.Tensor:
    knobs = rms_norm_knobs(gate.device, silu_block_rows=block_rows, silu_block_cols=block_cols,
                           silu_num_warps=num_warps)
    return kernels("rms_norm.kernel").act_mul_triton(gate, up, activation, knobs)


def silu_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *, block_rows: int | None = None,
             block_cols: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`silu(gate) * up`, a new contiguous `[T, I]` tensor in gate's dtype: gate_up `[T, 2I]` (gate's columns then
    up's, as GatedMLP's fused projection writes them) or a pair (gate, up) of `[T, I]` (any row strides,
    contiguous columns). silu in float32 rounded to the dtype (as GatedMLP's in-place silu stores it), then the
    product in float32 rounded once."""
    gate, up = _gate_and_up(gate_up)
    if not use_triton(gate):
        return silu_mul_torch((gate, up))
    return _act_mul(gate, up, "silu", block_rows, block_cols, num_warps)


def gelu_tanh_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *, block_rows: int | None = None,
                  block_cols: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (T5's gated-gelu feed-forward, Ankh's: transformers' gelu_new), a new contiguous
    `[T, I]` tensor in gate's dtype; gate_up and the launch knobs as silu_mul's (the same kernel and table row).

    The tanh GELU as torch computes aten gelu(approximate="tanh") on a GPU: in float32 from the dtype's value,
    0.5 x (1 + tanh(kBeta (x + kKappa x^3))) with torch's float32 constants, x^3 as (x x) x and the inner sum one
    fma (nvcc's contraction of torch's source); tanh is libdevice's `__nv_tanhf`, the function torch's `tanhf`
    compiles to (CUDA documents it within 2 ulps, not correctly rounded; Triton itself has no tanh). In the
    interpreter, which has no libdevice, tanh is a few-ulp form from numpy's exp and log (_cuda_math.tanh). The
    GELU is rounded to the dtype (as the unfused gelu stores it), then the product in float32 rounded once (as
    `mul_`): the bits of `pointwise.gelu_tanh(gate).mul_(up)`, gelu_tanh_mul_torch, up to tanh's last bit."""
    gate, up = _gate_and_up(gate_up)
    if not use_triton(gate):
        return gelu_tanh_mul_torch((gate, up))
    return _act_mul(gate, up, "gelu_tanh", block_rows, block_cols, num_warps)
