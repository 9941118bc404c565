"""float64 references for float32 tests: the same math in float64 as the exact values, and the bound that
holds our float32 error to the reference implementation's own float32 error against them.

Two float32 results compared with each other differ by both roundings, and those depend on the CPU's
kernels (BLAS blocking, vector width, FMA): a fixed bound on that difference passes on one CPU and fails
on another. Measured against float64, each float32 result has its own error; ours must be no larger than
FACTOR times the reference's (transformers', or torch's for kernels) plus FLOOR. Errors are relative to
the tensor's scale (`relative_error`); FACTOR and FLOOR are justified in tests/test_models_parity.py.

transformers' float64 models still run some steps in float32 (RMS norms, rotary angles, Qwen3.5's delta
rule and gates), so `float64_everywhere` turns every float32 a torch call asks for into float64.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from pipeline.engine.interface import ForwardOutput
from pipeline.engine.hf import HFEngine

FACTOR = 4.0
FLOOR = 1e-6     # of the tensor's scale: 8 float32 ulps (2^-23 = 1.2e-7)


class _Float32AsFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Inside, float32 is float64: `dtype=torch.float32`, `.float()`, `.to(torch.float32)` and factories
    without a dtype all give float64 (for a model loaded in float64; float32 tensors stay float32)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float32AsFloat64():
            yield
    finally:
        torch.set_default_dtype(before)


class Float64Transformers(HFEngine):
    """The hf engine on a checkpoint in float64 throughout, log-probabilities included (HFEngine computes
    those in float32 whatever the model's dtype)."""

    def __init__(self, model_path: str, logprobs: bool):
        with float64_everywhere():
            super().__init__(model_path, torch.device("cpu"), torch.float64, logprobs=logprobs)

    def forward(self, batch: Sequence[Sequence[int]], layers: Sequence[int], logprobs: bool) -> ForwardOutput:
        with float64_everywhere():
            out = super().forward(batch, layers, logprobs)
        assert all(h.dtype == torch.float64 for h in out.hidden.values())
        assert out.token_logprobs is None or out.token_logprobs.dtype == torch.float64
        return out


def _float64(a) -> torch.Tensor:
    return a.detach().cpu().double() if torch.is_tensor(a) else torch.from_numpy(np.asarray(a, np.float64))


def relative_error(x, exact) -> float:
    """max |x - exact| / max |exact|: the worst error in units of the tensor's scale."""
    x, exact = _float64(x), _float64(exact)
    assert x.shape == exact.shape and exact.abs().max() > 0, (x.shape, exact.shape)
    return ((x - exact).abs().max() / exact.abs().max()).item()


def assert_as_accurate(ours, theirs, exact, what: str, factor: float = FACTOR, floor: float = FLOOR) -> None:
    """Our error against `exact` is at most `factor` times the reference's (`theirs`) plus `floor`."""
    e_ours, e_theirs = relative_error(ours, exact), relative_error(theirs, exact)
    assert e_ours <= factor * e_theirs + floor, (
        f"{what}: error {e_ours:.3g} against float64, the reference's {e_theirs:.3g} "
        f"(bound {factor:g} x {e_theirs:.3g} + {floor:g})")


def assert_rows_as_accurate(ours: ForwardOutput, theirs: ForwardOutput, exact: ForwardOutput,
                            layers: Sequence[int], logprobs: bool) -> None:
    """Per checked layer and for token log-probabilities: `ours` is as accurate as `theirs`."""
    assert torch.equal(ours.cu_seqlens.cpu(), exact.cu_seqlens.cpu())
    for k in layers:
        assert_as_accurate(ours.hidden[k], theirs.hidden[k], exact.hidden[k], f"layer {k}")
    if logprobs:
        assert exact.token_logprobs.abs().sum() > 0
        assert_as_accurate(ours.token_logprobs, theirs.token_logprobs, exact.token_logprobs, "token log-probabilities")
