"""Timing on the GPU as the method asks (warm-ups first, CUDA events or triton's do_bench, medians) and
torch.profiler's kernel table; on CPU (--smoke) the same calls with the host clock and the CPU's ops."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .report import Report
from .setting import Setting


def time_ms(fn, setting: Setting, warmups: int | None = None, repeats: int | None = None) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn, after `warmups` untimed ones (Triton compiles there)."""
    for _ in range(setting.warmups if warmups is None else warmups):
        fn()
    times = []
    for _ in range(setting.repeats if repeats is None else repeats):
        if setting.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def bench_ms(fn, setting: Setting) -> float:
    """Median ms of a short op: triton's do_bench on the GPU (it flushes L2 between calls), best of 3 on CPU."""
    if setting.gpu:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    return min(time_ms(fn, setting, 0, 3))


@dataclass
class KernelTime:
    name: str
    count: int
    ms: float


def profile(fn, setting: Setting, runs: int = 1) -> tuple[list[KernelTime], float, float]:
    """(kernels by total time, kernel ms per run, wall ms per run) of `runs` calls of fn under torch.profiler:
    CUDA kernels (and copies) on the GPU, the CPU's own op times on CPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    activity = ProfilerActivity.CUDA if setting.gpu else ProfilerActivity.CPU
    with torch_profile(activities=[activity]) as prof:
        start = setting.clock()
        for _ in range(runs):
            fn()
        wall = (setting.clock() - start) * 1e3
    kernels = []
    for e in prof.key_averages():
        if setting.gpu:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            kernels.append(KernelTime(e.key, e.count, us / 1e3))
    kernels.sort(key=lambda k: -k.ms)
    return kernels, sum(k.ms for k in kernels) / runs, wall / runs


def short(name: str, width: int = 90) -> str:
    """A kernel name fit for a table cell (templated names run to hundreds of characters)."""
    name = name.replace("|", "/").replace("\n", " ")
    return name if len(name) <= width else name[:width - 3] + "..."


def kernel_table(report: Report, setting: Setting, kernels: list[KernelTime], step_ms: float, runs: int = 1,
                 top: int | None = None) -> None:
    top = top or (30 if setting.gpu else 8)   # a smoke run shows that the table prints, not its tail
    t = report.table("kernel" if setting.gpu else "CPU op (--smoke: no GPU kernels)", "count", "ms", "% of step")
    for k in kernels[:top]:
        t.row(short(k.name), k.count // runs, k.ms / runs, 100.0 * k.ms / runs / step_ms)
