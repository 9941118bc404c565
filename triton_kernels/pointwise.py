"""Element-wise functions on CPU whose every output element is the same bits wherever it sits in its tensor.

torch's CPU element-wise kernels run a tensor's elements in SIMD vectors, except the last few of each
thread's share, which go through a scalar loop; for exp, sigmoid, silu, softplus, erf, tanh, cos and sin the
vector and scalar code differ in the last bit for some inputs (Sleef's vector functions beside libm).
Which elements fall in a scalar tail depends on the tensor's size and the thread count, so a token's
activations would change with how many tokens share its step and with torch's threads.

Under `batch_invariant(True)` (the native engine sets it for batch-invariant runs) these functions run
over a tensor's elements in calls whose every thread's share is a whole number of vectors: with one
thread, one call over all but the last few elements; with k threads, calls of k x 32,768 elements
(torch gives each thread 32,768 of them), a shorter rest in one-thread calls of at most 16,384; the last
few elements are padded to whole vectors apart. So every element takes the vector code. Outside it they
are the plain torch calls.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

GRAIN = 1 << 15    # torch's element-wise grain size: a call splits among threads in shares of at least this
# Calls of at most this many elements run on one thread in every kernel used here: aten's GELU splits a
# larger call into one share per thread (numel / threads, not whole vectors: with 3 threads the tanh form
# then differs from one thread's in the last bit from 16,448 elements on; torch 2.13).
ONE_THREAD = 1 << 14
VECTOR = 64        # two 512-bit vectors of float32 (the unrolled loop's step); a multiple of every ISA's

# Set per step by the engine's model runner, as _device.torch_path_on_cpu is.
_BATCH_INVARIANT = contextvars.ContextVar("triton_kernels_batch_invariant_pointwise", default=False)


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Within the block, the functions here run position-independently (on CPU tensors)."""
    token = _BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def enabled() -> bool:
    return _BATCH_INVARIANT.get()


def _pieces(n: int) -> list[tuple[int, int]]:
    """[start, stop) calls over n elements, each a whole number of vectors per thread, and the rest (under
    VECTOR elements) last."""
    threads = torch.get_num_threads()
    step = n if threads == 1 else GRAIN * threads
    whole = n - n % VECTOR
    pieces = [(a, min(a + step, whole)) for a in range(0, whole, step)]
    if threads > 1 and pieces and (pieces[-1][1] - pieces[-1][0]) % (GRAIN * threads):
        # A short last call splits among fewer threads in shares that need not be whole vectors: its
        # whole vectors go ONE_THREAD at a time (one thread each).
        a, b = pieces.pop()
        pieces += [(c, min(c + ONE_THREAD, b)) for c in range(a, b, ONE_THREAD)]
    if whole < n:
        pieces.append((whole, n))
    return pieces


def _run(fn_out: Callable, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fn_out(input, out) over flat contiguous x into flat out (may be x), piece by piece."""
    for a, b in _pieces(x.numel()):
        if (b - a) % VECTOR == 0:
            fn_out(x[a:b], out[a:b])
        else:   # the last few: padded to one whole vector
            padded = x.new_zeros(VECTOR)
            padded[:b - a] = x[a:b]
            fn_out(padded, padded)
            out[a:b] = padded[:b - a]
    return out


def apply(fn_out: Callable, x: torch.Tensor) -> torch.Tensor:
    """fn_out(x, out) for an element-wise op with an out= form; under batch_invariant on CPU, position-
    independent. Returns a new tensor."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not enabled() or x.device.type != "cpu" or x.numel() == 0:
        fn_out(x, out)
        return out
    _run(fn_out, x.contiguous().view(-1), out.view(-1))
    return out


def apply_(fn_out: Callable, x: torch.Tensor) -> torch.Tensor:
    """The same op in place on x (returned); x must be contiguous under batch_invariant on CPU."""
    if not enabled() or x.device.type != "cpu" or x.numel() == 0:
        fn_out(x, x)
        return x
    flat = x.view(-1)
    _run(fn_out, flat, flat)
    return x


_aten = torch.ops.aten


def silu(x: torch.Tensor) -> torch.Tensor:
    return apply(lambda t, out: _aten.silu.out(t, out=out), x)


def silu_(x: torch.Tensor) -> torch.Tensor:
    return apply_(lambda t, out: _aten.silu.out(t, out=out), x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return apply(lambda t, out: _aten.sigmoid.out(t, out=out), x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return apply(lambda t, out: _aten.softplus.out(t, 1, 20, out=out), x)


def exp_(x: torch.Tensor) -> torch.Tensor:
    return apply_(lambda t, out: _aten.exp.out(t, out=out), x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The erf GELU."""
    return apply(lambda t, out: _aten.gelu.out(t, approximate="none", out=out), x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (transformers' gelu_new)."""
    return apply(lambda t, out: _aten.gelu.out(t, approximate="tanh", out=out), x)


@contextlib.contextmanager
def _one_thread_when_invariant(x: torch.Tensor):
    threads = torch.get_num_threads()
    alone = enabled() and x.device.type == "cpu" and threads > 1
    if alone:
        torch.set_num_threads(1)   # about 1 us there and back
    try:
        yield
    finally:
        if alone:
            torch.set_num_threads(threads)


def cos(x: torch.Tensor) -> torch.Tensor:
    """cos, on one thread under batch_invariant on CPU: with 2 threads aten's float32 cos gave other bits at a
    process's first call than at later ones on the same values (where inside aten, perhaps MKL's VML, is not
    pinned down)
    (tools/repro_first_forward.py: the rotary table's upper half), so a 2-thread worker's first batch
    differed from every other. The tables it computes here are small (tokens x rotary dim)."""
    with _one_thread_when_invariant(x):
        return apply(lambda t, out: _aten.cos.out(t, out=out), x)


def sin(x: torch.Tensor) -> torch.Tensor:
    """sin, on one thread under batch_invariant on CPU, as cos (its results did not change, but it is the
    same kind of call on the same tables)."""
    with _one_thread_when_invariant(x):
        return apply(lambda t, out: _aten.sin.out(t, out=out), x)
