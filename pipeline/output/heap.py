"""A merge's heap: freed window-sized arrays handed back to the system at once, so that the process's
resident memory is what its current window holds, not the high-water mark of all of them.

Why: glibc serves a block over its mmap threshold with a fresh mmap and unmaps it when freed, but each such
free raises the threshold (up to 32 MiB), so later window-sized arrays come from the heap, whose freed
blocks stay resident: at 20M rows a merge with 64 MiB windows peaked at 1.0 GiB, and at 0.46 GiB with the
threshold fixed (docs/BENCHMARKS.md). The worker does the opposite for its batches (worker/cpu_setup.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters (malloc.h)
_THRESHOLD = 1 << 20


def return_freed_arrays() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process (blocks above it are returned when freed);
    True if set, False off glibc."""
    return set_malloc(mmap_threshold=_THRESHOLD, trim_threshold=_THRESHOLD)


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process (a fixed mmap threshold also stops glibc
    adjusting either by itself); True if both were set, False off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def trim() -> bool:
    """Hand the heap's free blocks back to the system now (glibc's malloc_trim); True if it could be asked, False
    off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True
