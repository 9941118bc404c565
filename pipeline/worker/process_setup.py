"""What a worker sets up in its own process before its first op, once: its CPU threads (flushing float
denormals), and on a CPU MKL's matmul mode (strict for a batch-invariant run, checked by computing) and a
malloc that keeps freed memory, on a GPU Triton's kernel cache (docs/engine.md). Whichever load comes first
does it: the shard's, or a model loaded ahead while the parent planned (models/preload.py)."""
from __future__ import annotations

import logging
import os

from index.cache import cache_dir

from .cpu_setup import check_strict_matmuls, keep_freed_memory, set_cpu_threads, set_strict_matmuls

log = logging.getLogger("run_shards.worker")

_done: tuple | None = None   # the arguments this process was set up with
_said: list[str] = []        # what it logged of its setup (`say_again`)


def set_up(on_gpu: bool, batch_invariant: bool, run_root, threads: int) -> None:
    """Set this process up for a run on a GPU (`on_gpu`) or CPU whose values are `batch_invariant`, with
    `threads` CPU threads; a UserError (naming `run_root`'s rerun) where a batch-invariant CPU run's matmul
    mode cannot hold. Again with the same arguments: nothing (MKL takes its mode and the threads their flush
    only before the first op); with others, a RuntimeError, since nothing can set the process up twice."""
    global _done
    wanted = (on_gpu, batch_invariant, str(run_root), threads)
    if _done == wanted:
        return
    if _done is not None:
        raise RuntimeError(f"this worker was set up for {_done} before its shard asked for {wanted}")
    matmuls = None if on_gpu else set_strict_matmuls(batch_invariant, str(run_root))
    flushing = set_cpu_threads(threads)
    if batch_invariant and not on_gpu:   # MKL's reported mode, checked by computing (once its threads flush)
        matmuls = check_strict_matmuls(str(run_root))
    said = [f"{threads} CPU thread(s); float denormals " + (
        "flushed to zero" if flushing else
        "NOT flushed on every thread (unsupported, or torch's thread pool started first); CPU math on tiny values "
        "may run slower, results are unaffected")]
    if not on_gpu:
        said.append("malloc " + ("keeps freed memory for reuse" if keep_freed_memory() else
                                 "left at its defaults (not glibc); CPU runs may spend more time in page faults"))
        said.append(f"matmuls: {matmuls.text}")
    else:
        use_kernel_cache()
    for line in said:
        log.info("%s", line)
    _done, _said[:] = wanted, said   # (only once it all held: a refusal above is met again, and reported, by the shard's load)


def say_again() -> None:
    """Log again how this process was set up, for the log of a shard after its first (worker/entry.py), so each
    shard's log says its threads and matmul mode."""
    for line in _said:
        log.info("%s (as set up for this process's first shard)", line)


def use_kernel_cache() -> None:
    """Keep the GPU kernels Triton compiles (a few seconds each, at a worker's first batches) in run_shards'
    cache folder, `$RUN_SHARDS_CACHE/triton` (README), so the next run's workers load them instead, on every
    node that shares that folder; unless TRITON_CACHE_DIR names a folder of the user's own, or this one cannot
    be written (then Triton keeps its default, ~/.triton/cache). Triton's cache is keyed by the kernel's
    source, its compile options, the GPU and Triton's version, and written by atomic renames: workers of
    several runs and nodes may share it."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return
    folder = cache_dir() / "triton"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.info("Triton keeps its compiled kernels in its default folder: %s cannot be created (%s)", folder,
                 e.strerror or e)
        return
    if os.access(folder, os.W_OK | os.X_OK):
        os.environ["TRITON_CACHE_DIR"] = str(folder)
