"""The public ops `rotate_qk_`, `norm_rotate_` and `norm_rotate_qk_`: their checks, then the Triton kernels
(kernel.py, norm_rotate.py: imported only on that path, so a CPU-only install never imports triton) or the torch
paths."""
from __future__ import annotations

import torch

from .._device import kernels, knobs_for, use_triton
from ..launch_config import RotaryKnobs
from .torch_path import norm_rotate_torch_, rotate_qk_torch_


def rotary_knobs(device: torch.device, **given: int | None) -> RotaryKnobs:
    """The kernel's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "rotary", **given)


def rotate_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
               head_dim: int, q_scale: float = 1.0, block_rows: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """Scale the queries and rotate queries and keys of a fused projection in place; returns qkv.

    qkv `[T, (num_q_heads + 2 * num_kv_heads) * head_dim]` (any row stride, contiguous channels): each token's
    queries, then keys, then values, head after head. cos, sin `[T, rotary_dim]` or `[T, 1, rotary_dim]` (as
    Rotary.cos_sin gives them: the frequencies twice), rotary_dim even and <= head_dim: the first rotary_dim
    channels of each query and key head are rotated (rotate-half convention), the rest pass through. Queries are
    multiplied by q_scale first (rounded to qkv's dtype). Rotation in float32, stored in qkv's dtype.

    Tensors on CPU run rotate_qk_torch_ unless TRITON_INTERPRET=1. Launch knobs (Triton only): block_rows
    (token, head) rows per program, num_warps; None takes the launch table's row for the tensors' GPU.
    """
    T = qkv.shape[0]
    rd = cos.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(num_q_heads + 2 * num_kv_heads) * head_dim}] with contiguous channels, "
                         f"got {tuple(qkv.shape)} strides {qkv.stride()}")
    if rd % 2 or rd > head_dim or cos.shape != sin.shape or cos.numel() != T * rd:
        raise ValueError(f"cos and sin must be [T, rotary_dim] with an even rotary_dim <= {head_dim}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)} for T = {T}")
    if not use_triton(qkv):
        return rotate_qk_torch_(qkv, cos, sin, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, q_scale=q_scale)
    knobs = rotary_knobs(qkv.device, block_rows=block_rows, num_warps=num_warps)
    return kernels("rotary.kernel").rotate_qk_triton(qkv, cos, sin, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                     head_dim=head_dim, q_scale=q_scale, knobs=knobs)


def norm_rotate_knobs(device: torch.device, **given: int | None) -> RotaryKnobs:
    """The launch table's rotary row for `device`, with norm_block_elements / norm_num_warps given (not None)."""
    return knobs_for(device, "rotary", **given)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, head_dim: int,
           name: str = "x") -> None:
    rd = cos.shape[-1]
    if x.dim() != 3 or x.shape[-1] != head_dim or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, {head_dim}] with contiguous channels, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    T = x.shape[0]
    if rd % 2 or rd == 0 or rd > head_dim or cos.shape != sin.shape or cos.numel() != T * rd:
        raise ValueError(f"cos and sin must be [T, rotary_dim] with an even rotary_dim <= {head_dim}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)} for T = {T}")
    if weight is not None and weight.shape != (head_dim,):
        raise ValueError(f"{name}'s weight must be [{head_dim}], got {tuple(weight.shape)}")


def norm_rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                 zero_centred: bool, head_dim: int, float32_math: bool = False, block_rows: int | None = None,
                 num_warps: int | None = None) -> torch.Tensor:
    """RMS-normalise each head of x over head_dim, then rotate its first rotary_dim channels, in place; returns x.

    x `[T, H, head_dim]`: any token and head strides, contiguous channels (a view of a projection's output).
    weight `[head_dim]`: pipeline/models/layers/norms.py RMSNorm's (zero_centred: the scale is 1 + w, applied in
    float32 before the one cast; else the normalised value is cast, then multiplied by w and rounded again);
    None: no norm, the rotation only (Llama). cos, sin `[T, rotary_dim]` or `[T, 1, rotary_dim]` as Rotary.cos_sin
    gives them, rotary_dim even and <= head_dim; channels past it are normalised and not rotated. float32_math:
    Rotary.float32_math (rotate in float32, one rounding) or not (the dtype's ops, rounded as Rotary.apply's).

    Tensors on CPU run norm_rotate_torch_ unless TRITON_INTERPRET=1. Launch knobs (Triton only): block_rows
    (token, head) rows per program (a power of two), num_warps; None takes the launch table's row for the
    tensor's GPU (rows: as many heads as fit in its norm_block_elements).
    """
    _check(x, cos, sin, weight, head_dim)
    if not use_triton(x):
        return norm_rotate_torch_(x, cos, sin, weight, eps, zero_centred=zero_centred, float32_math=float32_math)
    kernels("rotary.norm_rotate").norm_rotate_triton(x, weight, None, None, cos, sin, eps, zero_centred, head_dim,
                                                     float32_math, block_rows,
                                                     norm_rotate_knobs(x.device, norm_num_warps=num_warps))
    return x


def norm_rotate_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *, zero_centred: bool,
                    head_dim: int, float32_math: bool = False, block_rows: int | None = None,
                    num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rotate_` of an attention layer's queries and keys in one launch: (q, k) updated in place and returned.

    q `[T, Hq, head_dim]`, k `[T, Hk, head_dim]` (each any token and head strides, contiguous channels, one dtype;
    views of the projection's output), their own norm weights (both None or both given; one convention, eps and
    rotation), the token's cos and sin shared. Each gets exactly what `norm_rotate_` gives it alone: the programs
    split between them, none holds rows of both."""
    _check(q, cos, sin, q_weight, head_dim, "q")
    _check(k, cos, sin, k_weight, head_dim, "k")
    if (q_weight is None) != (k_weight is None) or q.dtype != k.dtype or q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must share their tokens and dtype and both have a weight or neither, got "
                         f"{tuple(q.shape)} {q.dtype} and {tuple(k.shape)} {k.dtype}, weights "
                         f"{q_weight is not None} and {k_weight is not None}")
    if not use_triton(q):
        args = dict(zero_centred=zero_centred, float32_math=float32_math)
        return (norm_rotate_torch_(q, cos, sin, q_weight, eps, **args),
                norm_rotate_torch_(k, cos, sin, k_weight, eps, **args))
    kernels("rotary.norm_rotate").norm_rotate_triton(q, q_weight, k, k_weight, cos, sin, eps, zero_centred, head_dim,
                                                     float32_math, block_rows,
                                                     norm_rotate_knobs(q.device, norm_num_warps=num_warps))
    return q, k
