"""Which implementation an op runs for given tensors.

CUDA tensors run the Triton kernels. CPU tensors run the Triton kernels through the interpreter when
TRITON_INTERPRET=1 is set (it must be set before triton is imported), and the plain torch reference
otherwise, so the engine works on any machine.

Inside `_launch.dry_run(target)`, `meta` tensors take the Triton path too (their launches are recorded,
not run) and `target_of` answers with that target.

`torch_path_on_cpu()` lets a caller pin CPU tensors to the torch implementations whatever the
environment says: the native engine runs under it on CPU, so a test suite that sets TRITON_INTERPRET=1
for the kernel tests still runs whole models at torch speed rather than through the interpreter.

On the Triton path an op finds its launch knobs with `knobs_for` (the launch table's row for the tensors' GPU) and
its kernel module with `kernels`, which imports it (and triton) on first use only.
"""
import contextlib
import contextvars
import functools
import importlib
import os
from dataclasses import replace

import torch

from ._launch import H100, GpuTarget, dry_run_target
from .launch_config import launch_row

_FORCE_TORCH_ON_CPU = contextvars.ContextVar("triton_kernels_force_torch_on_cpu", default=False)


@contextlib.contextmanager
def torch_path_on_cpu():
    """Within this block, ops on CPU tensors run their torch implementation (CUDA tensors are unaffected)."""
    token = _FORCE_TORCH_ON_CPU.set(True)
    try:
        yield
    finally:
        _FORCE_TORCH_ON_CPU.reset(token)


def use_triton(t: torch.Tensor) -> bool:
    """True when `t`'s op should run the Triton kernel rather than the torch reference."""
    if t.is_cuda:
        return True
    if t.is_meta and dry_run_target() is not None:
        return True
    if _FORCE_TORCH_ON_CPU.get():
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


def target_of(device: torch.device) -> GpuTarget:
    """The GPU whose launch knobs apply to tensors on `device`.

    A CUDA device answers for itself (host-side properties, no sync). Elsewhere (the interpreter, a
    plan on a host without a GPU) it is the dry run's target, else an H100."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return GpuTarget(major * 10 + minor, torch.cuda.get_device_properties(device).multi_processor_count)
    return dry_run_target() or H100


def knobs_for(device: torch.device, kernel: str, **given):
    """The launch table's `kernel` row (a field of launch_config's rows: "norm", "chunk", ...) for `device`'s GPU,
    with the knobs given (not None) in place of the table's."""
    row = getattr(launch_row(target_of(device)), kernel)
    return replace(row, **{name: value for name, value in given.items() if value is not None})


@functools.cache
def kernels(module: str):
    """The module of Triton kernels `module` ("layer_norm.kernel": under triton_kernels), imported on first use: the
    public ops call their kernels through it, so a CPU process never imports triton (a CPU-only install has none),
    and a GPU step pays a cached lookup (~0.05 us) where an import statement in the op costs ~1 us a call."""
    return importlib.import_module(f"{__package__}.{module}")
