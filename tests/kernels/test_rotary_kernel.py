"""The fused query-scale + rotary kernel (triton_kernels/rotary) against transformers' ESM rotary in float64.

The reference we did not write is transformers' `apply_rotary_pos_emb` (modeling_esm) after ESM's query
scale, run in float64 on the same (already rounded) inputs: the exact values. The kernel (Triton: compiled on a
GPU, else the interpreter) and its torch path must each be as accurate in float32 as that function in float32
(FACTOR x its error + FLOOR); in float16 and bfloat16 each output is the exact rotation of the stored scaled
query rounded once (2^-11, 2^-8 of it; bfloat16 on the CPU through tests/interpreter_bfloat16.py). The
torch path must also equal, bit for bit, the unfused ops the CPU engine runs (q * scale, then Rotary.apply).
Values must not move outside the queries and keys: the value columns come back untouched.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.esm.modeling_esm import apply_rotary_pos_emb

from pipeline.models.layers.rotary import Rotary
from triton_kernels.rotary import rotate_qk_, rotate_qk_torch_
from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tables(positions: torch.Tensor, rotary_dim: int, dtype: torch.dtype):
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)), float32_math=True)
    return rotary, *rotary.cos_sin(positions, dtype)


def _reference(qkv: torch.Tensor, cos, sin, heads: int, kv_heads: int, dim: int, rotary_dim: int, scale: float,
               dtype: torch.dtype) -> torch.Tensor:
    """transformers' ESM query scale and rotation, in `dtype`, on the first rotary_dim channels of each head. The
    scaled query is rounded to qkv's own dtype first, as the model stores it before rotating."""
    T = qkv.shape[0]
    x = qkv.to(dtype)
    q = (qkv[:, :heads * dim] * scale).to(dtype).view(T, heads, dim).transpose(0, 1)[None]
    k = x[:, heads * dim:(heads + kv_heads) * dim].view(T, kv_heads, dim).transpose(0, 1)[None]
    c, s = cos.to(dtype).view(T, rotary_dim)[None], sin.to(dtype).view(T, rotary_dim)[None]
    qr, kr = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], c, s)
    q = torch.cat([qr, q[..., rotary_dim:]], -1)[0].transpose(0, 1).reshape(T, -1)
    k = torch.cat([kr, k[..., rotary_dim:]], -1)[0].transpose(0, 1).reshape(T, -1)
    return torch.cat([q, k, x[:, (heads + kv_heads) * dim:]], 1)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("heads,kv_heads,dim,rotary_dim", [(4, 4, 16, 16), (3, 3, 24, 24), (4, 2, 32, 16)])
def test_rotation_is_transformers_rotation(dtype, heads, kv_heads, dim, rotary_dim):
    skip_interpreter_bf16(dtype)
    torch.manual_seed(heads * dim + rotary_dim)
    T = 45   # rows of (token, head) straddle the kernel's row blocks
    positions = torch.randint(0, 1026, (T,))
    _, cos, sin = _tables(positions, rotary_dim, dtype)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, dtype=torch.float64).to(dtype)
    scale = dim ** -0.5
    exact = _reference(qkv, cos, sin, heads, kv_heads, dim, rotary_dim, scale, torch.float64)
    theirs = _reference(qkv, cos, sin, heads, kv_heads, dim, rotary_dim, scale, torch.float32)
    args = dict(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim, q_scale=scale)
    ours = rotate_qk_(qkv.clone().to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), block_rows=16, num_warps=4, **args)
    torch_path = rotate_qk_torch_(qkv.clone(), cos, sin, **args)
    values = slice((heads + kv_heads) * dim, None)
    assert torch.equal(ours[:, values].cpu(), qkv[:, values]) and torch.equal(torch_path[:, values], qkv[:, values])
    if dtype == torch.float32:
        assert_as_accurate(ours, theirs, exact, "rotate_qk_ (Triton)")
        assert_as_accurate(torch_path, theirs, exact, "rotate_qk_ (torch path)")
    else:   # rounded once to 16 bits from float32 math: within the dtype's unit roundoff
        unit = torch.finfo(dtype).eps / 2
        for got in (ours, torch_path):
            assert ((got.cpu().double() - exact).abs() <= exact.abs() * unit + 1e-6 * exact.abs().max()).all()


def test_torch_path_is_the_unfused_layer_bit_for_bit():
    """The CPU engine's bits: q * scale in the tensor's dtype, then Rotary.apply in float32 (esm.py's _qkv)."""
    torch.manual_seed(1)
    T, H, D = 30, 4, 24
    for dtype in (torch.float32, torch.bfloat16):
        rotary, cos, sin = _tables(torch.arange(T), D, dtype)
        qkv = torch.randn(T, 3 * H * D).to(dtype)
        q, k, _ = qkv.view(T, 3, H, D).unbind(1)
        want_q, want_k = rotary.apply(q * D ** -0.5, cos, sin), rotary.apply(k, cos, sin)
        got = rotate_qk_torch_(qkv.clone(), cos, sin, num_q_heads=H, num_kv_heads=H, head_dim=D, q_scale=D ** -0.5)
        got_q, got_k, _ = got.view(T, 3, H, D).unbind(1)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_bad_shapes_are_refused():
    qkv = torch.zeros(4, 3 * 2 * 16)
    cos = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="qkv must be"):
        rotate_qk_(qkv, cos, cos, num_q_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotate_qk_(qkv, torch.zeros(4, 18), torch.zeros(4, 18), num_q_heads=2, num_kv_heads=2, head_dim=16)
