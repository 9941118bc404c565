"""Which devices workers run on, decided in the parent without initialising CUDA."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import stat

from index import FastaError
from index.compressed import kind as compression
from index.id_hash import affinity_cpus

from ..cgroups import usable_cpus
from ..config import DEFAULT_TOKENS_CPU
from ..errors import UserError

log = logging.getLogger("run_shards")

DEFAULT_MAX_CPU_WORKERS = 4
# A default CPU worker is started for every this many batches of input at most: a worker costs a process, its
# imports and a copy of the model (~2.4 CPU s for the demo model), which a smaller share of the work does not repay
# (docs/BENCHMARKS.md, "Default CPU workers for a small input").
BATCHES_PER_CPU_WORKER = 4
# A gzip file's residues, estimated from its size before it is read: FASTA compresses ~3-4x; the estimate errs
# toward more residues (today's default worker count), never toward workers left idle on a large input.
GZIP_RATIO = 5


def physical_gpu_count() -> int:
    """GPUs the driver reports, via NVML or /proc, never through the CUDA runtime, and without importing torch
    (3.4 s of a run's start on an H100 machine, for a count: docs/BENCHMARKS.md)."""
    try:
        return _nvml_device_count()
    except OSError as e:   # no driver library (a CPU machine), or NVML refused: the driver's /proc entries say it too
        log.debug("GPU count from NVML unavailable (%s); reading /proc/driver/nvidia", e)
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


@contextlib.contextmanager
def _nvml():
    """The driver's own NVML library (what torch.cuda._device_count_nvml calls), initialised for the block and
    shut down after it; OSError when the library is missing or will not start."""
    import ctypes

    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
        raise OSError("nvmlInit_v2 failed")
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _nvml_device_count() -> int:
    """nvmlDeviceGetCount_v2; OSError when the library is missing or a call fails."""
    import ctypes

    with _nvml() as nvml:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("nvmlDeviceGetCount_v2 failed")
        return int(count.value)


def gpu_models(ids: list[str]) -> list[tuple[str, str, tuple[int, int]]]:
    """(id, name, compute capability) of each GPU id a worker is pinned to (an index, or a UUID as
    CUDA_VISIBLE_DEVICES may give it), read through NVML as physical_gpu_count reads the count (no CUDA, no
    torch); [] when NVML cannot say (no driver library, an id it does not know): then the workers' own check
    decide (engine/gpu_support.py)."""
    import ctypes
    try:
        with _nvml() as nvml:
            found = []
            for gpu in ids:
                handle = ctypes.c_void_p()
                if gpu.isdigit():
                    status = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(gpu)), ctypes.byref(handle))
                else:
                    status = nvml.nvmlDeviceGetHandleByUUID(gpu.encode(), ctypes.byref(handle))
                name = ctypes.create_string_buffer(96)
                major, minor = ctypes.c_int(0), ctypes.c_int(0)
                if status != 0 or nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0 or \
                        nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                    return []
                found.append((gpu, name.value.decode(errors="replace"), (major.value, minor.value)))
            return found
    except OSError:
        return []


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
    """The CPUs this process's threads can keep busy: those it may run on (its affinity: a SLURM task's cpuset,
    taskset), fewer where a cgroup's CPU quota grants less time (a container's or pod's CPU limit: cgroups.py)."""
    return usable_cpus(affinity_cpus())


def gpu_count_asked(gpus: str) -> int | None:
    """`--gpus` as a number of GPUs, or None for 'auto'."""
    if gpus == "auto":
        return None
    try:
        wanted = int(gpus)
    except ValueError:
        raise UserError(f"--gpus takes a number or 'auto' (got {gpus!r})") from None
    if wanted < 0:
        raise UserError("--gpus must be 0 or more")
    return wanted


def resolve(gpus: str, workers: int | None, threads: int | None = None, input_tokens: int | None = None,
            tokens_per_batch: int = DEFAULT_TOKENS_CPU) -> tuple[list[str], int, int]:
    """(GPU ids, number of workers, torch threads per worker) for `--gpus`, `--workers` and `--threads`.
    `input_tokens`: about how many residues the run has (input_size), which bounds the default number of CPU
    workers to one per BATCHES_PER_CPU_WORKER batches of `tokens_per_batch`; None where it cannot be told."""
    if threads is not None and threads < 1:
        raise UserError("--threads must be at least 1")
    visible = visible_gpus()
    wanted = gpu_count_asked(gpus)
    if wanted is None:
        wanted = len(visible)
    elif wanted > len(visible):
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
    if workers is not None:
        return [], workers, threads or max(1, cpu_count() // workers)
    workers = min(DEFAULT_MAX_CPU_WORKERS, cpu_count())
    threads = threads or max(1, cpu_count() // workers)
    if input_tokens is not None:   # (each keeps its threads: a small input repays more threads no more than
        # more workers, and an idle thread's spin-wait takes a busy machine's cores: docs/BENCHMARKS.md)
        workers = max(1, min(workers, -(-input_tokens // (BATCHES_PER_CPU_WORKER * tokens_per_batch))))
    return [], workers, threads


def input_size(paths: list[str]) -> int | None:
    """About how many residues `paths` hold, from their sizes alone (before any is read or indexed): a plain
    file's bytes (headers and line ends included, so never fewer), a gzip file's times GZIP_RATIO; None where a
    path is not a regular file (a pipe, a missing file: the index says what is wrong with it)."""
    total = 0
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):   # (opening a pipe would wait for its writer)
            return None
        try:
            packed = compression(path) is not None
        except FastaError:   # a compression run_shards does not read: the index refuses it, naming the command
            return None
        total += st.st_size * (GZIP_RATIO if packed else 1)
    return total


def tasks_get_gpu(gpus: str, sbatch: str) -> bool:
    """Whether each shard of a cluster run (SLURM, Ray) gets a GPU, decided where the run is planned (often
    a login node without GPUs): `--gpus 0` no, `--gpus N` (N >= 1) yes, `--gpus auto` when the --sbatch
    options ask for GPUs. The dtype's `auto` follows from it, and must be the same for every shard."""
    wanted = gpu_count_asked(gpus)
    if wanted is None:
        return any(word in sbatch for word in ("--gres=gpu", "--gres gpu", "--gpus", "--gpu"))
    return wanted > 0
