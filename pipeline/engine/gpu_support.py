"""Which GPUs the native engine runs on: its Triton kernels are compiled and checked for compute capability 8.0
and newer (triton_kernels/launch_config.py has rows for sm_80, sm_86-89, sm_90, sm_100 and sm_120), Triton's own
supported range. Asked twice: by the parent of a local run before any work, with the GPUs NVML names
(planning/devices.gpu_models), and by each worker for the GPU it was given, where the parent could not read them
(a cluster's login node, a machine without NVML)."""
from __future__ import annotations

import shlex
import sys

import torch

from ..errors import UserError

NATIVE_MIN_CAPABILITY = (8, 0)


def native_gpu_problem(gpus: list[tuple[str, str, tuple[int, int]]]) -> str | None:
    """Why the native engine cannot run on these GPUs ((id, name, compute capability) each), or None."""
    old = [f"GPU {gpu} ({name}, compute capability {major}.{minor})" for gpu, name, (major, minor) in gpus
           if (major, minor) < NATIVE_MIN_CAPABILITY]
    if not old:
        return None
    return (f"{', '.join(old)} cannot run the native engine: its Triton kernels need compute capability 8.0 or "
            "newer (A100, A10, A40, L4, L40S, RTX 30, 40 and 50 series, H100, B200). Run with --engine hf "
            "--dtype float16 (transformers' own kernels; GPUs before 8.0 have no bfloat16)")


def check_gpus(engine: str, gpus: list[tuple[str, str, tuple[int, int]]]) -> None:
    """Refuse the native engine, before any work, where every one of the run's GPUs ((id, name, capability), as
    planning/devices.gpu_models reads them in the parent) is older than its kernels. A machine mixing old and new
    GPUs is left to the workers (check_native_device): NVML numbers GPUs by PCI bus, CUDA fastest first, so an
    index may name another GPU there."""
    if engine == "native" and gpus and all(native_gpu_problem([gpu]) for gpu in gpus):
        raise UserError(native_gpu_problem(gpus) + ".")


def check_native_device(device: torch.device) -> None:
    """The worker's side of check_gpus, for the GPU it was given (a run planned where its GPUs could not be
    read: a cluster's login node, a machine without NVML)."""
    if device.type != "cuda":
        return
    problem = native_gpu_problem([(str(device.index or 0), torch.cuda.get_device_name(device),
                                   torch.cuda.get_device_capability(device))])
    if problem:
        raise UserError(problem + ", in a new run (a new --out: this one keeps its engine).")
    try:
        import triton   # noqa: F401 - the kernels import it when they first run; a GPU worker, ahead
    except ImportError as e:
        raise UserError(f"the native engine's GPU kernels are Triton kernels, and {sys.executable} cannot import "
                        f"triton ({e}): install it (`{shlex.quote(sys.executable)} -m pip install triton`), or run "
                        "with --engine hf in a new run (a new --out: this one keeps its engine).") from None


def describe_gpu(name: str, capability: tuple[int, int], num_sms: int) -> str:
    """A worker log's line about its GPU: what it is and which row of the launch table its kernels take (a GPU
    takes the row at or below its compute capability: triton_kernels/launch_config.py)."""
    from triton_kernels.launch_config import table_arch
    arch = capability[0] * 10 + capability[1]
    return (f"GPU {name}, compute capability {capability[0]}.{capability[1]}, {num_sms} SMs: the native engine's "
            f"Triton kernels take the launch table's sm_{table_arch(arch)} row")
