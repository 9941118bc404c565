"""The linear + erf-GELU product (triton_kernels/linear_gelu) against F.linear and F.gelu in float64.

Exact values: gelu(x @ w.T + b) in float64 on the same rounded inputs (transformers' ESM and BERT-style models
use this erf form). float32 (true float32 products): as accurate as torch's F.linear + F.gelu in float32
(FACTOR x + FLOOR). float16 and bfloat16: one rounding of a float32 accumulation, at most the dtype's unit roundoff
plus the accumulation error of K products. Shapes cross every tile edge (M, N and K not multiples of the blocks), with and without
bias; the row-group order is exercised by more row tiles than GROUP_M.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_kernels.linear_gelu import linear_gelu, linear_gelu_torch
from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KNOBS = dict(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("M,N,K", [(70, 100, 48), (33, 64, 40), (1, 40, 16)])
@pytest.mark.parametrize("with_bias", (True, False))
def test_linear_gelu_against_float64(dtype, M, N, K, with_bias):
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(N, K, generator=g, dtype=torch.float64) / K ** 0.5).to(dtype)
    b = (torch.randn(N, generator=g, dtype=torch.float64) * 0.5).to(dtype) if with_bias else None
    dev = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    ours = linear_gelu(dev(x), dev(w), dev(b), **KNOBS)
    exact = F.gelu(F.linear(x.double(), w.double(), None if b is None else b.double()))
    if dtype == torch.float32:
        assert_as_accurate(ours, linear_gelu_torch(x, w, b), exact, "linear_gelu")
    else:
        unit = torch.finfo(dtype).eps / 2   # 2^-11 (float16), 2^-8 (bfloat16)
        bound = exact.abs() * unit + K * unit * 1e-2 * exact.abs().max() + 1e-6
        assert ((ours.cpu().double() - exact).abs() <= bound).all()


def test_a_row_has_the_same_bits_in_any_batch():
    """Each output's reduction order depends on K and block_k only: rows computed alone equal rows of a batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 32, generator=g).to(torch.float16).to(DEVICE)
    w = (torch.randn(48, 32, generator=g) / 6).to(torch.float16).to(DEVICE)
    whole = linear_gelu(x, w, None, **KNOBS)
    assert torch.equal(linear_gelu(x[17:20], w, None, **KNOBS), whole[17:20])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weight"):
        linear_gelu(torch.zeros(4, 8), torch.zeros(3, 9))
