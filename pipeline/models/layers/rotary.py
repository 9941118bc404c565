"""Rotary position embeddings (rotate-half convention), full or partial, for ragged token batches.

Frequencies follow the checkpoint's config: the default rule is computed here, other rope types
(linear, llama3, yarn, ...) come from transformers' own table so scaled checkpoints match exactly.
"""
from __future__ import annotations

import torch

from triton_kernels import pointwise
from triton_kernels.rotary import norm_rotate_qk_

from ...errors import UserError
from ..checkpoint_facts import DYNAMIC_ROPE_TYPES


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float, int]:
    """(inv_freq [rotary_dim / 2] float32, attention scaling, rotary_dim) for a text config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if rope_type == "default":
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
        return inv_freq, 1.0, rotary_dim
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise UserError(f"rope type '{rope_type}' is not supported by --engine native; use --engine hf")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UserError(f"unknown rope type '{rope_type}'; use --engine hf")
    # Computed on the CPU even when the model is being built on the meta device: transformers' initialisers
    # (llama3's, yarn's) create tensors without a device, which would be meta tensors with no values.
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling), 2 * inv_freq.numel()


class Rotary:
    """cos/sin tables for the positions of one step, applied to `[T, heads, head_dim]` tensors."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, float32_math: bool = False):
        self.inv_freq = inv_freq.float()
        self.scaling = scaling
        self.rotary_dim = 2 * inv_freq.numel()
        self.float32_math = float32_math   # ESM rotates in float32; Llama-style models in the model dtype

    def to(self, device: torch.device) -> "Rotary":
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] each, in `dtype` (as transformers hands them to the attention layers)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = pointwise.cos(emb), pointwise.sin(emb)
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Rotate the first rotary_dim channels of x `[T, H, D]`; the rest pass through.

        in_place (for an x the caller owns, such as a norm's output): a partial rotation is written over
        x's first channels instead of concatenating it with a copy of the rest. Same values either way."""
        rd = self.rotary_dim
        rot = x[..., :rd]
        dtype = x.dtype
        if self.float32_math:
            rot = rot.float()
        half = rd // 2
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), written half by half into x * cos: the same
        # bits as building rotate_half (the products' signs are exact, a + (-b) is a - b), in three passes over
        # x instead of five (1.6x faster on CPU for ESM-2's [4k tokens, 20 heads, 16]).
        out = rot * cos
        x1, x2 = rot[..., :half], rot[..., half:]
        out[..., :half].sub_(x2 * sin[..., :half])
        out[..., half:].add_(x1 * sin[..., half:])
        out = out.to(dtype)
        if rd == x.shape[-1]:
            return out
        if in_place:
            x[..., :rd] = out
            return x
        return torch.cat((out, x[..., rd:]), dim=-1)

    def norm_apply_qk_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm=None,
                       k_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention layer's queries and keys `[T, H, D]` (views of a projection's output, any token and head
        strides) normalised by their norms (RMSNorms of layers/norms.py over D, both None or both given, of one
        convention and eps) and rotated as `apply` does, in place, in one launch (triton_kernels/rotary
        norm_rotate_qk_): the q/k norms and rotary of the RMS-norm decoders' fused layers on the Triton path. The
        CPU path keeps `norm(x)` then `apply`."""
        if q_norm is None:
            weights, eps, zero_centred = (None, None), 0.0, False
        else:
            assert (k_norm.eps, k_norm.zero_centred) == (q_norm.eps, q_norm.zero_centred), "one launch, one norm kind"
            weights, eps, zero_centred = (q_norm.weight, k_norm.weight), q_norm.eps, q_norm.zero_centred
        return norm_rotate_qk_(q, k, cos, sin, *weights, eps, zero_centred=zero_centred, head_dim=q.shape[-1],
                               float32_math=self.float32_math)
