"""The residual add + LayerNorm kernel (triton_kernels/layer_norm) against torch's add and LayerNorm in float64.

Exact values: the add and F.layer_norm in float64 on the same rounded inputs. float32: the kernel (Triton:
compiled on a GPU, else the interpreter) is as accurate as torch's float32 ops (FACTOR x their error + FLOOR).
16-bit: the sum is the exact sum rounded once (as torch's add stores it: bit for bit), and the normalised
rows are within a rounding of the exact LayerNorm of that stored sum. The torch path is the unfused ops, bit for
bit. Widths: a narrow one with several rows per program, a wide one with one, neither a power of two.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_kernels.layer_norm import add_layer_norm, add_layer_norm_torch
from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs(T: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, d, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    y = torch.randn(T, d, generator=g, dtype=torch.float64).to(dtype)
    w = (1 + 0.2 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype)
    b = (0.1 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype)
    return x, y, w, b


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("T,d", [(37, 100), (5, 1280)])
@pytest.mark.parametrize("with_residual", (True, False))
@pytest.mark.parametrize("with_bias", (True, False))
def test_add_layer_norm_against_float64(dtype, T, d, with_residual, with_bias):
    skip_interpreter_bf16(dtype)
    x, y, w, b = _inputs(T, d, dtype, seed=T + d)
    y = y if with_residual else None
    b = b if with_bias else None
    dev = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    s, out = add_layer_norm(dev(x), dev(y), dev(w), dev(b), 1e-5)
    ts, tout = add_layer_norm_torch(x, y, w, b, 1e-5)
    assert torch.equal(s.cpu(), ts)   # the sum rounded once, as torch stores it
    exact = F.layer_norm(ts.double(), (d,), w.double(), None if b is None else b.double(), 1e-5)
    if dtype == torch.float32:
        assert_as_accurate(out, tout, exact, "add_layer_norm")
    else:   # float32 statistics, one rounding of the output
        ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        assert ((out.cpu().double() - exact).abs() <= exact.abs() * ulp + 1e-5 * exact.abs().max()).all()


def test_torch_path_is_the_unfused_ops():
    x, y, w, b = _inputs(9, 64, torch.bfloat16, seed=3)
    s, out = add_layer_norm_torch(x, y, w, b, 1e-5)
    assert torch.equal(s, x + y) and torch.equal(out, F.layer_norm(x + y, (64,), w, b, 1e-5))
