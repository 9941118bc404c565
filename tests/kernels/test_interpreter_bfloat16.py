"""The interpreter's bfloat16 (tests/interpreter_bfloat16.py) against torch's own bfloat16 on the CPU, bit for bit:
torch computes each bfloat16 operation on the float32 values and rounds the result to nearest even, as a GPU's
bfloat16 instructions and conversions do. Each case runs one small kernel; only with the interpreter (a GPU
computes bfloat16 itself)."""
import pytest
import torch

from tests.run_helpers import require_triton

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.interpreter_bfloat16 import float32_to_bfloat16_bits, installed

pytestmark = pytest.mark.skipif(not installed(), reason="only where the Triton interpreter runs the kernels with "
                                                        "bfloat16 mended (tests/interpreter_bfloat16.py)")
N = 256


@triton.jit
def _binary_kernel(a_ptr, b_ptr, out_ptr, OP: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    if OP == "add":
        out = a + b
    elif OP == "sub":
        out = a - b
    elif OP == "mul":
        out = a * b
    elif OP == "div":
        out = a / b
    elif OP == "max":
        out = tl.maximum(a, b)
    elif OP == "min":
        out = tl.minimum(a, b)
    elif OP == "where_gt":
        out = tl.where(a > b, a, b)
    elif OP == "where_le":
        out = tl.where(a <= b, a, -b)
    else:
        out = -tl.abs(a) + a * -b
    tl.store(out_ptr + i, out)


def _values(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float())
    return x.bfloat16()


@pytest.mark.parametrize("op, reference", [
    ("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / b), ("max", torch.maximum), ("min", torch.minimum),
    ("where_gt", lambda a, b: torch.where(a > b, a, b)), ("where_le", lambda a, b: torch.where(a <= b, a, -b)),
    ("neg_abs", lambda a, b: -torch.abs(a) + a * -b),
])
def test_bfloat16_arithmetic_is_torchs_bit_for_bit(op, reference):
    a, b = _values(1), _values(2)
    b[:8] = a[:8]   # equal operands for the comparisons
    out = torch.empty_like(a)
    _binary_kernel[(1,)](a, b, out, OP=op, N=N)
    expected = reference(a, b)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), (out - expected).abs().max()


@triton.jit
def _cast_kernel(x_ptr, out_ptr, TO: tl.constexpr, RTZ: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    if RTZ:
        tl.store(out_ptr + i, x.to(TO, fp_downcast_rounding="rtz"))
    else:
        tl.store(out_ptr + i, x.to(TO))


def _float32_with_ties() -> torch.Tensor:
    """float32 values whose low 16 bits are each rounding case: exact ties (to even up and down), just below and
    above a tie, the largest float32 (rounds to infinity), +-0, +-infinity and subnormals."""
    g = torch.Generator().manual_seed(3)
    high = torch.randint(0, 0x7F7F, (N,), generator=g, dtype=torch.int64)
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0, 0xFFFF, 0x1234] * (N // 6 + 1))[:N]
    bits = (high << 16) | low
    bits[: N // 2] |= 1 << 31   # negative half
    x = bits.to(torch.int32).view(torch.float32).clone()
    x[-6:] = torch.tensor([torch.finfo(torch.float32).max, 0.0, -0.0, float("inf"), float("-inf"), 1e-40])
    return x


def test_casts_to_bfloat16_round_to_nearest_even_or_toward_zero():
    x = _float32_with_ties()
    out = torch.empty(N, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, TO=tl.bfloat16, RTZ=False, N=N)
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16))
    _cast_kernel[(1,)](x, out, TO=tl.bfloat16, RTZ=True, N=N)
    toward_zero = (x.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(out.view(torch.int16), toward_zero)
    # and the numpy helper itself on NaN: a quiet NaN
    assert torch.isnan(torch.from_numpy(float32_to_bfloat16_bits(torch.tensor([float("nan")]).numpy())
                                        .view("int16")).view(torch.bfloat16)).all()


@pytest.mark.parametrize("source, target", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
    (torch.int32, torch.bfloat16), (torch.bfloat16, torch.int32),
])
def test_casts_between_bfloat16_and_other_types_are_torchs(source, target):
    values = _values(4) * 100
    x = values.round().to(source) if not source.is_floating_point else values.to(source)
    out = torch.empty(N, dtype=target)
    tl_target = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                 torch.int32: tl.int32}[target]
    _cast_kernel[(1,)](x, out, TO=tl_target, RTZ=False, N=N)
    assert torch.equal(out, x.to(target))


@triton.jit
def _constant_fma_kernel(x_ptr, out_ptr, C, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, tl.fma(x, x, x * 0.1))
    tl.store(out_ptr + N + i, tl.full([N], 0.1, tl.bfloat16) + (C * x.to(tl.float32)).to(tl.bfloat16))


def test_constants_and_fma_round_once():
    x = _values(5)
    out = torch.empty(2 * N, dtype=torch.bfloat16)
    _constant_fma_kernel[(1,)](x, out, 0.3, N=N)
    tenth = torch.tensor(0.1).bfloat16()   # a constant meets bfloat16 as bfloat16 (Triton's typing)
    x_tenth = x * tenth
    fma = (x.double() * x.double() + x_tenth.double()).float().bfloat16()
    assert torch.equal(out[:N].view(torch.int16), fma.view(torch.int16))
    expected = tenth + (torch.tensor(0.3, dtype=torch.float32) * x.float()).bfloat16()
    assert torch.equal(out[N:].view(torch.int16), expected.view(torch.int16))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    tl.store(out_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))


def test_dot_of_bfloat16_multiplies_the_values_in_float32():
    a, b = _values(6, 32 * 32).view(32, 32), _values(7, 32 * 32).view(32, 32)
    out = torch.empty(32, 32)
    _dot_kernel[(1,)](a, b, out, N=32)
    exact = a.double() @ b.double()
    # float32 accumulation in some order: within 32 float32 roundings of the sum of |products|
    bound = 32 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
    assert ((out.double() - exact).abs() <= bound).all()


@triton.jit
def _reduce_kernel(x_ptr, out_ptr, OP: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r[:, None] * N + r[None, :])
    if OP == "max":
        tl.store(out_ptr + r, tl.max(x, axis=1))
    elif OP == "min":
        tl.store(out_ptr + r, tl.min(x, axis=1))
    else:
        tl.store(out_ptr + r, tl.sum(x, axis=1))


def test_max_and_min_over_bfloat16_compare_values_and_a_16_bit_sum_is_refused():
    x = _values(8, 16 * 16).view(16, 16)
    out = torch.empty(16, dtype=torch.bfloat16)
    _reduce_kernel[(1,)](x, out, OP="max", N=16)
    assert torch.equal(out, x.max(dim=1).values)
    _reduce_kernel[(1,)](x, out, OP="min", N=16)
    assert torch.equal(out, x.min(dim=1).values)
    with pytest.raises(Exception, match="order the compiled kernel chooses"):
        _reduce_kernel[(1,)](x, out, OP="sum", N=16)
