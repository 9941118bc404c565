"""Qwen3.5's gate kernels (triton_kernels/gates) against the same math in float64.

float32: each kernel (Triton: compiled on a GPU, else the interpreter) is as accurate as the unfused torch float32
ops (FACTOR x their error + FLOOR, tests/float64_reference.py), and the delta rule's g also element by element
(its softplus spans many magnitudes: a log1p computed as log(1 + x) would lose the small ones, which a max-scaled
error does not see). 16-bit (float16 and bfloat16; on the CPU bfloat16 through tests/interpreter_bfloat16.py): the
output gate within its two rounding points (the sigmoid rounded to the dtype, then the product), beta within one,
g (float32 from 16-bit a) as accurate as torch's float32 ops on the same a.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_kernels.gates import delta_rule_gates, delta_rule_gates_torch, sigmoid_gate, sigmoid_gate_torch
from tests.kernels.float_cases import DEVICE, randn64, skip_interpreter_bf16
from tests.float64_reference import FACTOR, FLOOR, assert_as_accurate

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _within_roundings(out, exact, dtype, roundings: int) -> None:
    u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    bound = exact.abs() * ((1 + u) ** roundings - 1) * 1.001 + 1e-6 * exact.abs().max()
    worst = ((out.cpu().double() - exact).abs() - bound).max().item()
    assert worst <= 0, f"{roundings} rounding(s) of {dtype} exceeded by {worst:.3g}"


def _elementwise_relative(x, exact) -> float:
    return ((x.cpu().double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(11, 3, 40), (3, 2, 256)])
def test_sigmoid_gate_against_float64(dtype, T, H, D):
    """o a strided view (a padded head dim cut back), the gate between its queries (head stride 2 D), as
    GatedAttention holds them; several heads a program at D = 40, fewer at 256."""
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(T * D)
    o_wide = randn64(g, T, H, D + 8, scale=2).to(dtype)
    qg = randn64(g, T, H, 2 * D, scale=4).to(dtype)
    o, gate = o_wide[..., :D], qg[..., D:]
    out = sigmoid_gate(o_wide.to(DEVICE)[..., :D], qg.to(DEVICE)[..., D:])
    assert out.dtype == dtype and out.shape == (T, H * D) and out.is_contiguous()
    exact = o.double().reshape(T, -1) * torch.sigmoid(gate.double()).reshape(T, -1)
    if dtype == torch.float32:
        assert_as_accurate(out, sigmoid_gate_torch(o, gate), exact, "sigmoid_gate")
    else:
        _within_roundings(out, exact, dtype, 2)
        # the sigmoid rounded to the dtype before the product, as torch.sigmoid stores it
        stored = (o.double() * torch.sigmoid(gate.double()).to(dtype).double()).reshape(T, -1)
        _within_roundings(out, stored, dtype, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,HV", [(70, 16), (5, 6)])
def test_delta_rule_gates_against_float64(dtype, T, HV):
    """a and b column views of a wider projection output (as the mixer's are); a + dt_bias from -60 to 40, across
    softplus's threshold of 20 and where exp(x) is far below 1 (log1p's range)."""
    skip_interpreter_bf16(dtype)
    g = torch.Generator().manual_seed(T + HV)
    wide = randn64(g, T, 2 * HV + 9, scale=4).to(dtype)
    wide[:, 3:3 + HV] = torch.linspace(-60, 40, T * HV, dtype=torch.float64).reshape(T, HV).to(dtype)
    a, b = wide[:, 3:3 + HV], wide[:, 3 + HV:3 + 2 * HV]
    A_log = (0.5 * randn64(g, HV)).to(dtype)
    dt_bias = (0.3 * randn64(g, HV)).to(dtype)
    dev = wide.to(DEVICE)
    out_g, beta = delta_rule_gates(dev[:, 3:3 + HV], dev[:, 3 + HV:3 + 2 * HV], A_log.to(DEVICE), dt_bias.to(DEVICE))
    assert out_g.dtype == torch.float32 and beta.dtype == dtype and out_g.shape == beta.shape == (T, HV)
    assert out_g.is_contiguous() and beta.is_contiguous()
    exact_g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    exact_beta = torch.sigmoid(b.double())
    torch_g, torch_beta = delta_rule_gates_torch(a, b, A_log, dt_bias)
    assert_as_accurate(out_g, torch_g, exact_g, "g")
    ours, theirs = _elementwise_relative(out_g, exact_g), _elementwise_relative(torch_g, exact_g)
    assert ours <= FACTOR * theirs + FLOOR, f"g element by element: {ours:.3g} against torch's {theirs:.3g}"
    if dtype == torch.float32:
        assert_as_accurate(beta, torch_beta, exact_beta, "beta")
    else:
        _within_roundings(beta, exact_beta, dtype, 1)


def test_torch_paths_are_the_unfused_ops():
    """What the engine's layers compute (qwen3_5.py GatedAttention, gated_deltanet.py), bit for bit."""
    g = torch.Generator().manual_seed(3)
    qg = randn64(g, 5, 2, 32).to(torch.bfloat16)
    o = randn64(g, 5, 2, 16).to(torch.bfloat16)
    gate = qg[..., 16:]
    assert torch.equal(sigmoid_gate_torch(o, gate), o.reshape(5, 32) * torch.sigmoid(gate.reshape(5, 32)))
    ab = randn64(g, 5, 8, scale=5).to(torch.bfloat16)
    A_log, dt_bias = randn64(g, 4).to(torch.bfloat16), randn64(g, 4).to(torch.bfloat16)
    gg, beta = delta_rule_gates_torch(ab[:, :4], ab[:, 4:], A_log, dt_bias)
    assert torch.equal(gg, -A_log.float().exp() * F.softplus(ab[:, :4].float() + dt_bias))
    assert torch.equal(beta, torch.sigmoid(ab[:, 4:]))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape and dtype"):
        sigmoid_gate(torch.zeros(4, 2, 8), torch.zeros(4, 2, 9))
    with pytest.raises(ValueError, match="one shape and dtype"):
        sigmoid_gate(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="one shape"):
        delta_rule_gates(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"A_log and dt_bias must be \[3\]"):
        delta_rule_gates(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(2), torch.zeros(3))
