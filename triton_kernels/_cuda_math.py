"""exp and log1p in float32 as CUDA's math library computes them (what torch's CUDA kernels call), for the
kernels that must round where torch does.

tl.exp compiles to the fast ex2.approx form, which differs from CUDA's `expf` in the last bits; torch's sigmoid
and softplus on a GPU call `expf` (`std::exp`) and `log1pf` in float32, so a kernel that should store torch's bits
calls libdevice's `__nv_expf` / `__nv_log1pf` (these helpers) instead. The Triton interpreter has no libdevice: there
`exp` is numpy's and `log1p` is Goldberg's `log(1 + x) * x / ((1 + x) - 1)` (a few ulps, accurate for small x
where log(1 + x) alone is not). Which pair is decided when this module is imported, as Triton decides compiled
or interpreted when a kernel is decorated (TRITON_INTERPRET=1 must be set before either).
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
else:
    from triton.language.extra import libdevice

    @triton.jit
    def exp(x):
        return libdevice.exp(x)

    @triton.jit
    def log1p(x):
        return libdevice.log1p(x)


@triton.jit
def sigmoid(x):
    """torch's float32 sigmoid on a GPU: 1 / (1 + exp(-x)), the division correctly rounded as nvcc compiles
    torch's `/` (Triton's own `/` is the approximate div.full.f32)."""
    return tl.math.div_rn(1.0, 1.0 + exp(-x))


@triton.jit
def softplus(x):
    """torch's softplus with beta 1 and threshold 20 on a GPU: x above 20, else log1p(exp(x))."""
    return tl.where(x > 20.0, x, log1p(exp(x)))
