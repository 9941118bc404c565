"""norm_rotate_ (triton_kernels/rotary/norm_rotate.py): the q/k RMS norm and rotary of the RMS-norm decoders in one
pass, against the same math in float64.

Exact values: the per-head RMS norm (zero-centred (1 + w), Llama's w, or none) and the rotate-half rotation in
float64 on the same stored inputs and cos/sin tables. float32: the kernel (Triton: compiled on a GPU, else the
interpreter) and its torch path are as accurate as the unfused float32 layer ops the CPU engine runs (RMSNorm, then
Rotary.apply: FACTOR x their error + FLOOR, tests/float64_reference.py). float16 (bfloat16 only on a GPU, the
interpreter computes it wrongly): each output within its rounding points of the exact value (the norm's one or two
roundings carried through the rotation, the products' rounding, the sum's), and at least 98% of the outputs bit for
bit the unfused ops' rounding points applied to the exact normalised values (a float32 statistic may move a
rounding); with no norm (Llama) all of them. Views as the layers pass them: Qwen3.5's queries between their gates
(head stride 2 head_dim), keys inside a wider projection row; what lies outside the view comes back untouched.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.models.layers.norms import RMSNorm
from pipeline.models.layers.rotary import Rotary
from triton_kernels._device import torch_path_on_cpu
from triton_kernels.rotary import norm_rotate_, norm_rotate_qk_, norm_rotate_torch_
from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (name, heads, head_dim, rotary_dim, norm: "zero_centred" | "llama" | None, float32_math, layout)
CASES = [
    ("qwen3_5 q", 3, 32, 8, "zero_centred", False, "gated"),    # partial rotary, head stride 2 head_dim
    ("qwen3 k", 2, 24, 24, "llama", False, "row"),               # full rotary inside a wider projection row
    ("llama q", 3, 16, 16, None, False, "row"),                  # no norm: the rotation alone
    ("partial, no norm", 2, 24, 8, None, False, "row"),          # the channels past the rotation untouched
    ("float32 rotation", 2, 20, 12, "zero_centred", True, "gated"),
]


def _view(wide: torch.Tensor, T: int, H: int, D: int, layout: str) -> torch.Tensor:
    """The [T, H, D] tensor the layer normalises and rotates, as a view of the projection output `wide`."""
    if layout == "gated":   # [query | gate] per head, then whatever follows (keys, values)
        return wide[:, :2 * H * D].view(T, H, 2 * D)[..., :D]
    return wide[:, 5:5 + H * D].view(T, H, D)


def _inputs(name, T, H, D, rd, norm, layout, dtype):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    wide = (torch.randn(T, 2 * H * D + 11, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rd, 2).double() / rd)), float32_math=False)
    cos, sin = rotary.cos_sin(torch.randint(0, 3000, (T,), generator=g), dtype)
    w = None
    if norm is not None:
        w = (0.3 * torch.randn(D, generator=g, dtype=torch.float64) + (norm != "zero_centred")).to(dtype)
    return wide, rotary, cos, sin, w


def _rms64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)


def _exact_norm(x: torch.Tensor, w, norm) -> torch.Tensor:
    if norm is None:
        return x.double()
    return _rms64(x) * ((1 + w.double()) if norm == "zero_centred" else w.double())


def _rotate64(n, cos, sin, rd, rnd=lambda v: v):
    """[T, H, D] float64 -> the first rd channels rotated (rnd: where a rounding to the dtype is emulated)."""
    c, s, h = cos.double(), sin.double(), rd // 2
    n1, n2 = n[..., :h], n[..., h:rd]
    out = n.clone()
    out[..., :h] = rnd(rnd(n1 * c[..., :h]) - rnd(n2 * s[..., :h]))
    out[..., h:rd] = rnd(rnd(n2 * c[..., h:]) + rnd(n1 * s[..., h:]))
    return out


def _unfused(x, rotary, cos, sin, w, norm, float32_math):
    """The CPU engine's layer ops: RMSNorm (norms.py), then Rotary.apply."""
    if norm is not None:
        m = RMSNorm(x.shape[-1], EPS, zero_centred=norm == "zero_centred").to(x.dtype)
        m.weight.data.copy_(w)
        x = m(x)
    rotary.float32_math = float32_math
    return rotary.apply(x, cos, sin)


def _run(wide, T, H, D, layout, cos, sin, w, norm, float32_math, **knobs):
    wide = wide.to(DEVICE)
    x = _view(wide, T, H, D, layout)
    out = norm_rotate_(x, cos.to(DEVICE), sin.to(DEVICE), None if w is None else w.to(DEVICE), EPS,
                       zero_centred=norm == "zero_centred", head_dim=D, float32_math=float32_math, **knobs)
    assert out.data_ptr() == x.data_ptr()
    return wide.cpu(), out.cpu()


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("name,H,D,rd,norm,float32_math,layout", CASES, ids=[c[0] for c in CASES])
def test_norm_rotate_against_float64(dtype, name, H, D, rd, norm, float32_math, layout):
    skip_interpreter_bf16(dtype)
    T = 13   # 39 or 26 (token, head) rows: straddles the 16-row blocks asked for below
    wide, rotary, cos, sin, w = _inputs(name, T, H, D, rd, norm, layout, dtype)
    x = _view(wide, T, H, D, layout)
    got_wide, ours = _run(wide.clone(), T, H, D, layout, cos, sin, w, norm, float32_math, block_rows=16,
                          num_warps=4)
    torch_wide = wide.clone()
    torch_path = norm_rotate_torch_(_view(torch_wide, T, H, D, layout), cos, sin, w, EPS,
                                    zero_centred=norm == "zero_centred", float32_math=float32_math)
    for after in (got_wide, torch_wide):   # nothing outside the view moved
        outside = torch.ones_like(wide, dtype=torch.bool)
        _view(outside, T, H, D, layout).fill_(False)
        assert torch.equal(after[outside], wide[outside])
    n = _exact_norm(x, w, norm)
    exact = _rotate64(n, cos, sin, rd)
    if dtype == torch.float32:
        theirs = _unfused(x.clone(), rotary, cos, sin, w, norm, float32_math)
        assert_as_accurate(ours, theirs, exact, f"norm_rotate_ {name} (Triton)")
        assert_as_accurate(torch_path, theirs, exact, f"norm_rotate_ {name} (torch path)")
        return
    u = UNIT[dtype]
    norm_roundings = {None: 0, "zero_centred": 1, "llama": 2}[norm]
    h = rd // 2
    size = n.abs().clone()   # |n1 c| + |n2 s| where rotated: what the norm's and the products' roundings scale
    size[..., :h] = (n[..., :h] * cos[..., :h].double()).abs() + (n[..., h:rd] * sin[..., :h].double()).abs()
    size[..., h:rd] = (n[..., h:rd] * cos[..., :h].double()).abs() + (n[..., :h] * sin[..., :h].double()).abs()
    products = 0 if float32_math else 1
    bound = ((norm_roundings + products) * u * size + u * exact.abs()) * 1.001 + 1e-5 * exact.abs().max()
    bound[..., rd:] = norm_roundings * u * n[..., rd:].abs() * 1.001 + 1e-5 * exact.abs().max()
    for got in (ours, torch_path):
        worst = ((got.double() - exact).abs() - bound).max().item()
        assert worst <= 0, f"{name}: rounding bound exceeded by {worst:.3g}"
    # The unfused ops' rounding points, emulated on the exact normalised values.
    to = lambda v: v.to(dtype).double()   # noqa: E731
    if norm == "llama":
        stored = to(w.double() * to(_rms64(x)))
    else:
        stored = to(n)
    emulated = to(_rotate64(stored, cos, sin, rd, rnd=(lambda v: v) if float32_math else to))
    same = (ours.double() == emulated).float().mean().item()
    assert same == 1.0 if norm is None else same >= 0.98, f"{name}: {same:.3f} of the outputs as the unfused ops"


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("norm,Hk", [("zero_centred", 2), ("llama", 1), (None, 3)])
def test_norm_rotate_qk_is_norm_rotate_of_each(dtype, norm, Hk):
    """q and k in one launch: each bit for bit what norm_rotate_ gives it alone, q between its gates and k after
    them in one projection row (Qwen3.5's layout), nothing else in the row touched; one key head (multi-query) too.
    T * heads straddles the 16-row programs, so the first k program follows a partial q one."""
    T, H, D, rd = 13, 3, 32, 8
    wide, _, cos, sin, w = _inputs(f"qk {norm}", T, H + Hk, D, rd, norm, "gated", dtype)
    wide = wide[:, :2 * H * D + Hk * D + 7].contiguous()
    kw = None if w is None else w.flip(0)   # the keys' own weight

    def views(t):
        return _view(t, T, H, D, "gated"), t[:, 2 * H * D:2 * H * D + Hk * D].view(T, Hk, D)

    args = dict(zero_centred=norm == "zero_centred", head_dim=D, block_rows=16, num_warps=4)
    dev = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    one = wide.clone().to(DEVICE)
    q, k = views(one)
    assert norm_rotate_qk_(q, k, dev(cos), dev(sin), dev(w), dev(kw), EPS, **args) == (q, k)
    apart = wide.clone().to(DEVICE)
    q, k = views(apart)
    norm_rotate_(q, dev(cos), dev(sin), dev(w), EPS, **args)
    norm_rotate_(k, dev(cos), dev(sin), dev(kw), EPS, **args)
    assert torch.equal(one.cpu(), apart.cpu())
    moved = one.cpu() != wide
    q, k = views(moved)
    assert q.any() and k.any() and moved.sum() == q.sum() + k.sum()
    torch_path = wide.clone()   # the torch path (CPU tensors): the same two calls
    with torch_path_on_cpu():
        norm_rotate_qk_(*views(torch_path), cos, sin, w, kw, EPS, zero_centred=norm == "zero_centred", head_dim=D)
    reference = wide.clone()
    for x, weight in zip(views(reference), (w, kw)):
        norm_rotate_torch_(x, cos, sin, weight, EPS, zero_centred=norm == "zero_centred", float32_math=False)
    assert torch.equal(torch_path, reference)


def test_zero_rows_and_bad_shapes():
    x = torch.zeros(0, 2, 8)
    cos = torch.zeros(0, 1, 8)
    assert norm_rotate_(x.to(DEVICE), cos.to(DEVICE), cos.to(DEVICE), None, EPS, zero_centred=False,
                        head_dim=8).shape == (0, 2, 8)
    with pytest.raises(ValueError, match="contiguous channels"):
        norm_rotate_(torch.zeros(4, 2, 16)[..., ::2], torch.zeros(4, 8), torch.zeros(4, 8), None, EPS,
                     zero_centred=False, head_dim=8)
    with pytest.raises(ValueError, match="even rotary_dim"):
        norm_rotate_(torch.zeros(4, 2, 8), torch.zeros(4, 10), torch.zeros(4, 10), None, EPS, zero_centred=False,
                     head_dim=8)
    with pytest.raises(ValueError, match="both have a weight or neither"):
        norm_rotate_qk_(torch.zeros(4, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 8), torch.zeros(4, 8),
                        torch.ones(8), None, EPS, zero_centred=False, head_dim=8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        norm_rotate_(torch.zeros(4, 2, 8), torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(9), EPS,
                     zero_centred=False, head_dim=8)
