"""How a CPU worker process tunes itself before its first op: MKL in strict CNR mode, torch threads that
flush float denormals, the strict mode checked, and a malloc that keeps freed memory (docs/engine.md and
docs/BENCHMARKS.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..advice import command
from ..errors import UserError

if TYPE_CHECKING:
    from ..engine.mkl_cnr import MatmulMode


def set_strict_matmuls(batch_invariant: bool = True, run_dir: str | None = None) -> "MatmulMode":
    """For a batch-invariant process, put MKL in strict CNR mode before its first op; else leave MKL as it
    is. Returns what MKL reports (computing nothing: `check_strict_matmuls`, once the threads are set up,
    checks it). With `run_dir` (a worker of a run whose result says it is batch-invariant), a UserError if it
    does not hold here.

    Why: on Intel CPUs MKL's sgemm otherwise splits a product's reduction by its row count and the thread
    count (rows of a 1,024 -> 256 product with 2 threads differed in the last bits from 1 thread's for
    every row count up to 100), so stored values would depend on the number of workers and the token
    budget. MKL accepts the mode only before it first computes, hence here, first. Runs that are not
    batch-invariant keep MKL's default mode: strict mode makes tiny products slower (the demo model 7%;
    docs/BENCHMARKS.md). The parent promised the property after asking the same question in its own
    process (engine/config.batch_invariance_holds); a worker that cannot keep it (its MKL used before this
    call, another MKL_CBWR, another CPU) must not write rows under that promise. (torch is imported here,
    not with the module, as in the functions below.)"""
    from ..engine import mkl_cnr
    mode = mkl_cnr.set_strict_mode() if batch_invariant else mkl_cnr.current()
    if batch_invariant and run_dir and not mode.holds:
        raise _cannot_keep(mode, run_dir)
    return mode


def check_strict_matmuls(run_dir: str | None = None) -> "MatmulMode":
    """After set_strict_matmuls and set_cpu_threads: whether this process's products keep their rows' bits
    at any row and thread count, checked by computing some (engine/mkl_cnr.strict_matmuls: the mode MKL
    reports is not taken on trust, since a CPU may report strict mode and run otherwise). With `run_dir`,
    as set_strict_matmuls, a UserError where it does not hold.

    Why after the threads: the check runs products on 1 to 3 threads, which starts torch's thread pool, and
    threads take set_cpu_threads' denormal flush only if they start after it."""
    from ..engine import mkl_cnr
    mode = mkl_cnr.strict_matmuls()
    if run_dir and not mode.holds:
        raise _cannot_keep(mode, run_dir)
    return mode


def _cannot_keep(mode: "MatmulMode", run_dir: str) -> UserError:
    return UserError(f"this worker cannot compute the run's rows batch-invariant, as its result file will say they "
                     f"are: {mode.text}. Fix that, then `{command('rerun', run_dir)}`")


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
    from ..output.heap import set_malloc
    return set_malloc(mmap_threshold=32 << 20, trim_threshold=2**31 - 1)
