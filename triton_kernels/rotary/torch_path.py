"""`rotate_qk_` in plain torch: the query scale in the tensor's dtype, then the rotate-half rotation in float32,
written back in place. The same ops, in the same order, as an unfused layer runs them (q * scale, then
Rotary.apply with float32 math), so the bits are those."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x `[T, H, D]` -> its first rotary_dim channels rotated in float32 (x * cos + rotate_half(x) * sin), in x's
    dtype; cos, sin `[T, 1, rotary_dim]`."""
    rot = x[..., :rotary_dim].float()
    half = rotary_dim // 2
    out = rot * cos
    out[..., :half].sub_(rot[..., half:] * sin[..., :half])
    out[..., half:].add_(rot[..., :half] * sin[..., half:])
    return out.to(x.dtype)


def rotate_qk_torch_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, q_scale: float) -> torch.Tensor:
    """See kernel.rotate_qk_; returns qkv."""
    T, D = qkv.shape[0], head_dim
    rd = cos.shape[-1]
    cos, sin = cos.reshape(T, 1, rd), sin.reshape(T, 1, rd)
    q = qkv[:, :num_q_heads * D].view(T, num_q_heads, D)
    k = qkv[:, num_q_heads * D:(num_q_heads + num_kv_heads) * D].view(T, num_kv_heads, D)
    if q_scale != 1.0:
        q.copy_(q * q_scale)
    q[..., :rd] = _rotate(q, cos, sin, rd)
    k[..., :rd] = _rotate(k, cos, sin, rd)
    return qkv


def norm_rotate_torch_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, *, zero_centred: bool, float32_math: bool) -> torch.Tensor:
    """See norm_rotate.norm_rotate_: RMSNorm's ops (norms.py, as on a GPU), then Rotary.apply's, written back
    into x; returns x."""
    T, D = x.shape[0], x.shape[-1]
    rd = cos.shape[-1]
    cos, sin = cos.reshape(T, 1, rd), sin.reshape(T, 1, rd)
    n = x
    if weight is not None:
        if zero_centred:
            n = F.rms_norm(x.float(), (D,), 1.0 + weight.float(), eps).to(x.dtype)
        else:
            n = (weight * F.rms_norm(x.float(), (D,), None, eps).to(x.dtype)).to(x.dtype)
    rot = n[..., :rd].float() if float32_math else n[..., :rd]
    half = rd // 2
    out = rot * cos
    out[..., :half].sub_(rot[..., half:] * sin[..., :half])
    out[..., half:].add_(rot[..., :half] * sin[..., half:])
    if weight is not None and rd < D:
        x[..., rd:] = n[..., rd:]
    x[..., :rd] = out
    return x
