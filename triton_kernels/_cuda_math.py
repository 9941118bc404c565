"""exp, log1p and tanh in float32 as CUDA's math library computes them (what torch's CUDA kernels call), for the
kernels that must round where torch does.

tl.exp compiles to the fast ex2.approx form, which differs from CUDA's `expf` in the last bits; torch's sigmoid
and softplus on a GPU call `expf` (`std::exp`) and `log1pf` in float32, so a kernel that should store torch's bits
calls libdevice's `__nv_expf` / `__nv_log1pf` (these helpers) instead. Triton has no tanh of its own; torch's tanh
GELU calls `tanhf`, libdevice's `__nv_tanhf` (within 2 ulps by CUDA's documentation, not correctly rounded), which
`tanh` here calls. The Triton interpreter has no libdevice: there `exp` is numpy's, `log1p` is Goldberg's
`log(1 + x) * x / ((1 + x) - 1)` (a few ulps, accurate for small x where log(1 + x) alone is not), and `tanh` of
|x| is `1 - 2 / (exp(2|x|) + 1)` from 0.55 on (about an ulp, where the GELU's `1 + tanh` cancels), below that
`-m / (m + 2)` with m = expm1(-2|x|) by Kahan's `(u - 1) * y / log(u)`, u = exp(y) (a few ulps, accurate near 0
where the first form is not). Which pair is decided when this module is imported, as Triton decides compiled or
interpreted when a kernel is decorated (TRITON_INTERPRET=1 must be set before either).
"""
import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def exp(x):
        return tl.exp(x)

    @triton.jit
    def log1p(x):
        u = 1.0 + x
        exact = u == 1.0   # x below half an ulp of 1: log1p(x) is x (and u - 1 would divide by zero)
        return tl.where(exact, x, tl.log(u) * (x / tl.where(exact, 1.0, u - 1.0)))

    @triton.jit
    def tanh(x):
        # tanh(10) is 1 in float32: the clamp keeps exp(2a) finite and exp(-2a) above zero (log(u) finite).
        a = tl.minimum(tl.abs(x), 10.0)
        y = -2.0 * a
        u = tl.exp(y)
        exact = u == 1.0   # |y| below half an ulp of 1: expm1(y) is y
        m = tl.where(exact, y, (u - 1.0) * (y / tl.log(tl.where(exact, 0.5, u))))
        t = tl.where(a < 0.55, -m / (m + 2.0), 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0))
        return tl.where(x < 0, -t, t)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def exp(x):
        return libdevice.exp(x)

    @triton.jit
    def log1p(x):
        return libdevice.log1p(x)

    @triton.jit
    def tanh(x):
        return libdevice.tanh(x)


@triton.jit
def sigmoid(x):
    """torch's float32 sigmoid on a GPU: 1 / (1 + exp(-x)), the division correctly rounded as nvcc compiles
    torch's `/` (Triton's own `/` is the approximate div.full.f32)."""
    return tl.math.div_rn(1.0, 1.0 + exp(-x))


@triton.jit
def softplus(x):
    """torch's softplus with beta 1 and threshold 20 on a GPU: x above 20, else log1p(exp(x))."""
    return tl.where(x > 20.0, x, log1p(exp(x)))
