"""The RMS-norm kernels (triton_kernels/rms_norm) against the same math in float64.

Exact values: the ops in float64 on the same rounded inputs (the sum as torch's add stores it). float32: each
kernel (Triton: compiled on a GPU, else the interpreter) is as accurate as the unfused torch float32 ops
(FACTOR x their error + FLOOR, tests/float64_reference.py). 16-bit (float16 and bfloat16; on the CPU bfloat16
through tests/interpreter_bfloat16.py): the sum is bit for bit torch's add, and each output is within its rounding
points of the exact value: one rounding (2^-11 of the value in float16) for the zero-centred norm and the gated
norm, two for the Llama-order norm (the normalised value rounded, then its product with w) and for silu_mul (silu
rounded, then the product); plus 1e-5 of the tensor's scale for float32 statistics and subnormals. Widths: a
narrow one with several rows per program, a wide one with one, neither a power of two.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triton_kernels.rms_norm import (add_rms_norm, add_rms_norm_torch, gated_rms_norm, gated_rms_norm_torch,
                                     gelu_tanh_mul, gelu_tanh_mul_torch, silu_mul, silu_mul_torch)
from tests.kernels.float_cases import DEVICE, randn64, skip_interpreter_bf16
from tests.float64_reference import assert_as_accurate

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _unit_roundoff(dtype) -> float:
    return {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]


def _within_roundings(out, exact, dtype, roundings: int) -> None:
    out = out.cpu().double()
    bound = exact.abs() * roundings * _unit_roundoff(dtype) * 1.001 + 1e-5 * exact.abs().max()
    worst = ((out - exact).abs() - bound).max().item()
    assert worst <= 0, f"{roundings} rounding(s) of {dtype} exceeded by {worst:.3g}"


def _dev(t):
    return None if t is None else t.to(DEVICE)


def _rms64(s: torch.Tensor) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d", [(37, 100), (3, 1100)])
@pytest.mark.parametrize("with_residual", (True, False))
@pytest.mark.parametrize("zero_centred", (True, False))
def test_add_rms_norm_against_float64(dtype, T, d, with_residual, zero_centred):
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(T + d)
    x = randn64(g, T, d, scale=3, shift=1).to(dtype)
    y = randn64(g, T, d).to(dtype) if with_residual else None
    w = (0.2 * randn64(g, d) + (0.0 if zero_centred else 1.0)).to(dtype)
    s, out = add_rms_norm(_dev(x), _dev(y), _dev(w), EPS, zero_centred=zero_centred)
    ts, tout = add_rms_norm_torch(x, y, w, EPS, zero_centred=zero_centred)
    assert torch.equal(s.cpu(), ts) and (y is not None or s.data_ptr() == _dev(x).data_ptr() or DEVICE == "cpu")
    assert out.dtype == dtype and out.shape == (T, d)
    exact = _rms64(ts) * ((1 + w.double()) if zero_centred else w.double())
    if dtype == torch.float32:
        assert_as_accurate(out, tout, exact, "add_rms_norm")
    else:
        _within_roundings(out, exact, dtype, 1 if zero_centred else 2)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("x_dtype,y_dtype", [(torch.float32, None), (None, torch.float32),
                                             (torch.float32, torch.float32)])
def test_add_rms_norm_of_a_float32_residual_stream_in_a_16_bit_model(dtype, x_dtype, y_dtype):
    """T5 in float16 (its `wo` kept float32, as transformers does): the residual stream is float32 from the first
    feed-forward on, the norms' outputs in the weight's dtype (T5LayerNorm: the normalised value cast to it, then
    times the weight). The sum as torch promotes it (a 16-bit x plus a float32 y is float32), bit for bit; the
    norm within its two roundings in the 16-bit dtype."""
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(11)
    T, d = 19, 300
    x = randn64(g, T, d, scale=3, shift=1).to(x_dtype or dtype)
    y = randn64(g, T, d).to(y_dtype or dtype)
    w = (1.0 + 0.2 * randn64(g, d)).to(dtype)
    s, out = add_rms_norm(_dev(x), _dev(y), _dev(w), EPS, zero_centred=False, out_dtype=dtype)
    ts, tout = add_rms_norm_torch(x, y, w, EPS, zero_centred=False, out_dtype=dtype)
    assert s.dtype == ts.dtype == torch.float32 and torch.equal(s.cpu(), ts)
    assert out.dtype == tout.dtype == dtype
    from pipeline.models.t5 import T5LayerNorm   # the model's own norm on the same sum: the same roundings
    norm = T5LayerNorm(d, EPS)
    norm.weight.data = w
    exact = _rms64(ts) * w.double()
    for h in (out, tout, norm(ts)):
        assert h.dtype == dtype
        _within_roundings(h, exact, dtype, 2)
    _, alone = add_rms_norm(_dev(ts), None, _dev(w), EPS, zero_centred=False, out_dtype=dtype)
    assert alone.dtype == dtype
    _within_roundings(alone, exact, dtype, 2)


def test_add_rms_norm_rounds_where_transformers_does():
    """The Llama order (normalised value rounded, then scaled) and the zero-centred one differ in 16 bits: the
    kernel follows each (float16, where the two give different bits on these rows)."""
    g = torch.Generator().manual_seed(5)
    x = randn64(g, 8, 64, scale=2).to(torch.float16)
    w = (1 + 0.3 * randn64(g, 64)).to(torch.float16)
    _, llama = add_rms_norm(_dev(x), None, _dev(w), EPS, zero_centred=False)
    wc = w - 1   # stored as w - 1, not always exactly: the exact scale is 1 + wc
    _, centred = add_rms_norm(_dev(x), None, _dev(wc), EPS, zero_centred=True)
    n = _rms64(x)
    two = (n.to(torch.float16).double() * w.double()).to(torch.float16)    # Llama: two roundings
    one = (n * (1 + wc.double())).to(torch.float16)                        # zero-centred: one
    assert not torch.equal(two, one)
    assert (llama.cpu() != two).float().mean() < 0.02 and (centred.cpu() != one).float().mean() < 0.02
    once = (n * w.double()).to(torch.float16)   # w applied before the one rounding: not what Llama does
    assert (llama.cpu() != two).sum() < (llama.cpu() != once).sum()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(13, 3, 40), (20, 96)])
def test_gated_rms_norm_against_float64(dtype, shape):
    """o contiguous, z a strided view (a column slice of a wider projection output, as the mixer's z is)."""
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(len(shape))
    T, V = shape[0], shape[-1]
    width = 1
    for n in shape[1:]:
        width *= n
    o = randn64(g, *shape, scale=2).to(dtype)
    wide = randn64(g, T, width + 17, scale=2).to(dtype)
    z = wide[:, 5:5 + width].view(shape)
    w = (1 + 0.2 * randn64(g, V)).to(dtype)
    out = gated_rms_norm(_dev(o), _dev(wide)[:, 5:5 + width].view(shape), _dev(w), EPS)
    assert out.dtype == dtype and out.shape == shape
    exact = _rms64(o) * w.double() * F.silu(z.double())
    if dtype == torch.float32:
        assert_as_accurate(out, gated_rms_norm_torch(o, z, w, EPS), exact, "gated_rms_norm")
    else:
        _within_roundings(out, exact, dtype, 1)


def _gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# (fused op, its torch path, the activation in float64)
GATED = {"silu": (silu_mul, silu_mul_torch, lambda x: F.silu(x.double())),
         "gelu_tanh": (gelu_tanh_mul, gelu_tanh_mul_torch, _gelu_tanh64)}


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,n", [(19, 300), (3, 1030), (9, 513)])
def test_activation_mul_against_float64(activation, dtype, T, n):
    """The fused projection's output [T, 2I] (gate then up), and a pair of views. Sizes off the 8 x 512 tiles: a
    partial column tile, three column tiles with a partial last, a row and a column past whole tiles."""
    skip_interpreter_bf16(dtype)
    fused, torch_path, act64 = GATED[activation]
    g = torch.Generator().manual_seed(T * n)
    gate_up = randn64(g, T, 2 * n, scale=3).to(dtype)
    out = fused(_dev(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(out.cpu(), fused((_dev(gate), _dev(up))).cpu())
    assert out.dtype == dtype and out.shape == (T, n) and out.is_contiguous()
    exact = act64(gate) * up.double()
    if dtype == torch.float32:
        assert_as_accurate(out, torch_path(gate_up), exact, f"{activation}_mul")
    else:
        _within_roundings(out, exact, dtype, 2)


@pytest.mark.parametrize("activation", GATED)
def test_activation_mul_of_an_empty_step(activation):
    fused = GATED[activation][0]
    out = fused(_dev(torch.zeros(0, 2 * 40, dtype=torch.float16)))
    assert out.shape == (0, 40) and out.dtype == torch.float16


def _gelu_tanh_as_cuda(x: torch.Tensor) -> torch.Tensor:
    """torch's CUDA tanh GELU in float32 (ActivationGeluKernel.cu as nvcc compiles it: x^3 as (x x) x, the inner
    sum one fma), with a correctly rounded tanh; float64 holds each step's exact value before its rounding."""
    f32 = lambda v: v.float().double()   # noqa: E731
    x = x.double()
    beta, kappa = f32(torch.tensor(math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5)), f32(torch.tensor(0.044715))
    cube = f32(f32(x * x) * x)
    inner = f32(beta * f32(kappa * cube + x))   # kappa * cube is exact in float64: one rounding, as the fma
    return f32(f32(0.5 * x) * f32(1 + f32(torch.tanh(inner)))).float()


def test_gelu_tanh_mul_rounds_where_torch_does():
    """float16: the GELU rounded to the dtype, then the product rounded (torch's gelu, then mul_), not the float32
    product rounded once. Bits can differ from the model below only where tanh's last bit does (the interpreter's
    tanh is not libdevice's); rounding the product once differs far more often."""
    g = torch.Generator().manual_seed(11)
    gate, up = randn64(g, 64, 256, scale=2).to(torch.float16), randn64(g, 64, 256, scale=2).to(torch.float16)
    out = gelu_tanh_mul((_dev(gate), _dev(up))).cpu()
    act = _gelu_tanh_as_cuda(gate)
    twice = (act.to(torch.float16).float() * up.float()).to(torch.float16)
    once = (act * up.float()).to(torch.float16)
    assert (out != twice).float().mean() < 0.002
    assert (out != twice).sum() * 20 < (out != once).sum()


def test_torch_paths_are_the_unfused_ops():
    g = torch.Generator().manual_seed(3)
    x, y = randn64(g, 9, 64).to(torch.bfloat16), randn64(g, 9, 64).to(torch.bfloat16)
    w = (1 + 0.1 * randn64(g, 64)).to(torch.bfloat16)
    s, h = add_rms_norm_torch(x, y, w, EPS, zero_centred=False)
    assert torch.equal(s, x + y)
    assert torch.equal(h, w * F.rms_norm((x + y).float(), (64,), None, EPS).to(torch.bfloat16))
    _, h = add_rms_norm_torch(x, y, w, EPS, zero_centred=True)
    assert torch.equal(h, F.rms_norm((x + y).float(), (64,), 1 + w.float(), EPS).to(torch.bfloat16))
    assert torch.equal(silu_mul_torch(torch.cat([x, y], 1)), F.silu(x) * y)
    assert torch.equal(gelu_tanh_mul_torch(torch.cat([x, y], 1)), F.gelu(x, approximate="tanh") * y)


def test_bad_shapes_are_refused():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="contiguous channels"):
        add_rms_norm(x, torch.zeros(4, 9), torch.ones(8), EPS, zero_centred=False)
    with pytest.raises(ValueError, match="one shape"):
        gated_rms_norm(torch.zeros(4, 2, 8), torch.zeros(4, 2, 9), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul((torch.zeros(4, 8), torch.zeros(4, 7)))
    with pytest.raises(ValueError, match="contiguous columns"):
        gelu_tanh_mul((torch.zeros(4, 8), torch.zeros(8, 4).t()))
