"""Which devices workers run on, decided in the parent without initialising CUDA."""
from __future__ import annotations

import glob
import os

from ..errors import UserError


DEFAULT_MAX_CPU_WORKERS = 4


def physical_gpu_count() -> int:
    """GPUs the driver reports, via NVML or /proc, never through the CUDA runtime."""
    try:
        import torch.cuda
        count = torch.cuda._device_count_nvml()
        if count >= 0:
            return count
    except Exception:
        pass
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def visible_gpus() -> list[str]:
    """GPU ids a worker can be pinned to: the CUDA_VISIBLE_DEVICES list when set, else 0..count-1."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [e.strip() for e in env.split(",") if e.strip()]
        if any(e.startswith("-") for e in entries):  # CUDA ignores everything from a negative id on
            entries = entries[:next(i for i, e in enumerate(entries) if e.startswith("-"))]
        return entries
    return [str(i) for i in range(physical_gpu_count())]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve(gpus: str, workers: int | None, threads: int | None = None) -> tuple[list[str], int, int]:
    """(GPU ids, number of workers, torch threads per worker) for `--gpus`, `--workers` and `--threads`."""
    if threads is not None and threads < 1:
        raise UserError("--threads must be at least 1")
    visible = visible_gpus()
    if gpus == "auto":
        wanted = len(visible)
    else:
        try:
            wanted = int(gpus)
        except ValueError:
            raise UserError(f"--gpus takes a number or 'auto' (got {gpus!r})") from None
        if wanted < 0:
            raise UserError("--gpus must be 0 or more")
        if wanted > len(visible):
            where = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}" \
                if "CUDA_VISIBLE_DEVICES" in os.environ else "the driver"
            raise UserError(f"--gpus {wanted}: only {len(visible)} GPU(s) visible ({where}). "
                            "Use --gpus auto, a smaller number, or --gpus 0 --workers K for CPU workers.")
    if wanted > 0:
        if workers not in (None, wanted):
            raise UserError(f"--workers {workers} with --gpus {wanted}: GPU runs use one worker per GPU")
        return visible[:wanted], wanted, threads or max(1, cpu_count() // wanted)
    # Several single-threaded workers beat one multi-threaded worker on CPU (docs/BENCHMARKS.md: on 2 cores,
    # 2 workers x 1 thread gave 1.2-1.3x the tokens/s of 1 worker x 2 threads), up to a few model copies.
    workers = workers or min(DEFAULT_MAX_CPU_WORKERS, cpu_count())
    return [], workers, threads or max(1, cpu_count() // workers)


def resolve_for_tasks(gpus: str, sbatch: str) -> bool:
    """Whether each shard of a cluster run (SLURM, Ray) gets a GPU, decided where the run is planned (often
    a login node without GPUs): `--gpus 0` no, `--gpus N` (N >= 1) yes, `--gpus auto` when the --sbatch
    options ask for GPUs. The dtype's `auto` follows from it, and must be the same for every shard."""
    if gpus == "auto":
        return any(word in sbatch for word in ("--gres=gpu", "--gres gpu", "--gpus", "--gpu"))
    try:
        wanted = int(gpus)
    except ValueError:
        raise UserError(f"--gpus takes a number or 'auto' (got {gpus!r})") from None
    if wanted < 0:
        raise UserError("--gpus must be 0 or more")
    return wanted > 0


def set_cpu_threads(threads: int, flush_denormals: bool = True) -> bool:
    """Give this process `threads` torch CPU threads that flush float denormals to zero (unless
    `flush_denormals` is False, which benchmarks use to measure the difference); True when the flush
    holds on every thread.

    Why: float32 values below 1.2e-38 (denormals) cost a microcode assist per operation on x86 CPUs. The
    delta rule's decays exp(gamma_i - gamma_j) pass through that range whenever a chunk's gates are
    strongly negative: on one batch of a 1/8-size Qwen3.5 the native delta rule ran twice as fast with
    the flush, and end to end the demo model ran 1.15x (hf) and 1.32x (native) faster (docs/BENCHMARKS.md).
    Flushed values are below anything float32 or bfloat16 outputs can resolve next to O(1) ones; float16
    storage of small values is not affected.

    The flush is a per-thread CPU flag that threads inherit when they are created, so it must be set
    before torch starts its OpenMP pool, i.e. before the process's first multi-threaded op. The check
    runs one op across all threads and reports whether every one of them flushed.
    """
    import torch
    supported = flush_denormals and torch.set_flush_denormal(True)
    torch.set_num_threads(threads)
    if not supported:
        return False
    probe = torch.full((max(1, threads) * (1 << 16),), 1e-30)
    return bool(((probe * 1e-10) == 0).all())


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse instead of handing them back to the OS; True if set.

    Why: a CPU forward pass allocates and frees the same tens of MiB of activations every layer. By
    default glibc serves blocks over its mmap threshold (at most 32 MiB) with fresh mmaps and returns
    freed heap tops to the OS, so each new tensor's pages fault in again: one forward pass of the
    1/8-size Qwen3.5 took 429k page faults and 4.3 s instead of 3.5 s (the count varies from run to run
    with glibc's history), and about a thousand faults with this setting (docs/BENCHMARKS.md). The cost is that the process keeps its peak heap; a worker's batches all have
    the same token budget, so its peak is reached in the first batches anyway. Blocks over 32 MiB still
    come from mmap (glibc's upper limit for the threshold). No-op off glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # A fixed mmap threshold also stops glibc's dynamic adjustment of the trim threshold.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
