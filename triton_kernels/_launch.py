"""Every Triton launch of this package goes through `launch`, so it can also be planned without running.

Inside `dry_run(target)` nothing runs: each launch is recorded (kernel, grid, arguments, constexprs,
num_warps, num_stages) and ops called on `meta` tensors take their Triton path with the launch knobs
chosen for `target`. The compile-matrix test uses this to compile, ahead of time and for GPUs it does
not have, exactly the launches the engine would make (tests/kernels/test_compile_matrix.py).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

# GPUs the launch table's rows were compiled for, with their SM counts: A100 SXM (sm_80), L40S (sm_89, for the
# row of sm_86 to sm_89: RTX 30xx / 40xx, A10, A40, L4, L40S), H100 SXM (sm_90), B200 (sm_100), RTX 5090 (sm_120).
SM_COUNTS = {80: 108, 89: 142, 90: 132, 100: 148, 120: 170}


@dataclass(frozen=True)
class GpuTarget:
    """What the launch knobs depend on: the compute capability (major * 10 + minor) and the SM count."""

    arch: int
    num_sms: int


H100 = GpuTarget(90, SM_COUNTS[90])
A100 = GpuTarget(80, SM_COUNTS[80])
L40S = GpuTarget(89, SM_COUNTS[89])
B200 = GpuTarget(100, SM_COUNTS[100])
RTX5090 = GpuTarget(120, SM_COUNTS[120])


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)`."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1


_DRY_RUN: contextvars.ContextVar = contextvars.ContextVar("triton_kernels_dry_run", default=None)


@contextlib.contextmanager
def dry_run(target: GpuTarget):
    """Record launches instead of running them; `meta` tensors plan for `target`. Yields the list."""
    launches: list[Launch] = []
    token = _DRY_RUN.set((target, launches))
    try:
        yield launches
    finally:
        _DRY_RUN.reset(token)


def dry_run_target() -> GpuTarget | None:
    state = _DRY_RUN.get()
    return None if state is None else state[0]


def launch(kernel, grid: tuple[int, ...], *args, num_warps: int, num_stages: int = 1, **constexprs) -> None:
    """Launch `kernel` (or record the launch inside `dry_run`)."""
    state = _DRY_RUN.get()
    if state is not None:
        state[1].append(Launch(kernel, tuple(grid), args, constexprs, num_warps, num_stages))
        return
    kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
