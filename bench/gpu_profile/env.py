"""Step env: the card as found (clocks and power from nvidia-smi, read only), the software, and two measured
ceilings the other steps' numbers are read against: a large device-to-device copy and an 8192^3 bf16 product."""
from __future__ import annotations

import platform
import shutil
import subprocess

import torch

from .report import Report
from .setting import Setting
from .timing import median, time_ms

SMI_TIMEOUT_S = 5
SMI_SECTIONS = ("Clocks", "Max Clocks", "GPU Power Readings", "Power Readings", "Clocks Event Reasons",
                "Clocks Throttle Reasons")


def _wanted(section: str, key: str) -> bool:
    """Current and maximum clocks, power draw and limits, and why clocks are held back (driver versions name
    these fields differently: "Power Draw", "Average Power Draw", "Instantaneous Power Draw", ...)."""
    if section not in SMI_SECTIONS:
        return False
    return key in ("Graphics", "SM", "Memory") or "Power Draw" in key or "Power Limit" in key or "Reasons" in section


def nvidia_smi(report: Report) -> None:
    if shutil.which("nvidia-smi") is None:
        report.line("nvidia-smi: not on the PATH (no NVIDIA driver here)")
        return
    try:   # (a bound well inside the step's own 20 s: the versions and ceilings below still come out)
        text = subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,POWER"], capture_output=True, text=True,
                              timeout=SMI_TIMEOUT_S).stdout
    except (subprocess.TimeoutExpired, OSError) as e:
        report.line(f"nvidia-smi -q -d CLOCK,POWER: no answer ({type(e).__name__}: {e}); clocks and power left out")
        return
    rows, section = [], ""
    for line in text.splitlines():
        if ":" not in line:
            section = line.strip()
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        if value and _wanted(section, key):
            rows.append((f"{section} / {key}", value))
    if not rows:   # a layout this parser does not know: the text itself, not nothing
        report.line("nvidia-smi -q -d CLOCK,POWER (unparsed):\n```\n" + "\n".join(text.splitlines()[:60]) + "\n```")
        return
    t = report.table("nvidia-smi -q -d CLOCK,POWER", "value")
    for name, value in rows:
        t.row(name, value)


def versions(report: Report, setting: Setting) -> None:
    import numpy
    import transformers
    rows = [("python", platform.python_version()), ("torch", torch.__version__), ("CUDA (torch)", torch.version.cuda),
            ("numpy", numpy.__version__), ("transformers", transformers.__version__)]
    try:
        import triton
        rows.append(("triton", triton.__version__))
    except ImportError:
        rows.append(("triton", "not importable"))
    try:
        import fla
        rows.append(("fla-core", getattr(fla, "__version__", "?")))
    except Exception as e:  # noqa: BLE001 - any failure to import is "not available", said as such
        rows.append(("fla-core", f"not importable ({type(e).__name__})"))
    if setting.gpu:
        p = torch.cuda.get_device_properties(setting.device)
        rows += [("GPU", p.name), ("compute capability", f"sm_{p.major}{p.minor}"), ("SMs", p.multi_processor_count),
                 ("memory", f"{p.total_memory / 2**30:.1f} GiB"),
                 ("L2", f"{getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")]
    else:
        rows.append(("device", f"CPU ({platform.machine()}), {torch.get_num_threads()} torch threads (--smoke)"))
    t = report.table("software / device", "version")
    for name, value in rows:
        t.row(name, value)
        report.keep(name, value)


def ceilings(report: Report, setting: Setting) -> None:
    """GB/s of a copy (bytes read + written) and TFLOP/s of a square bf16 product, random data, median of repeats."""
    nbytes, n = (2 << 30, 8192) if setting.gpu else (16 << 20, 256)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=setting.device).normal_()
    dst = torch.empty_like(src)
    ms = median(time_ms(lambda: dst.copy_(src), setting, 3, 10))
    copy = 2 * nbytes / ms / 1e6
    del src, dst
    a = torch.randn(n, n, device=setting.device).to(setting.dtype)
    b = torch.randn(n, n, device=setting.device).to(setting.dtype)
    ms_mm = median(time_ms(lambda: a @ b, setting, 3, 10))
    tflops = 2 * n**3 / ms_mm / 1e9
    t = report.table("ceiling", "size", "ms", "rate")
    t.row("device-to-device copy (read + write)", f"{nbytes >> 20} MiB", ms, f"{copy:,.0f} GB/s")
    t.row(f"matmul {str(setting.dtype).removeprefix('torch.')}, random", f"{n}^3", ms_mm, f"{tflops:,.0f} TFLOP/s")
    report.keep("copy_GBps", copy)
    report.keep("matmul_TFLOPs", tflops)
    report.headline(f"ceilings: copy {copy:,.0f} GB/s, {n}^3 matmul {tflops:,.0f} TFLOP/s")


def run(setting: Setting, report: Report) -> None:
    nvidia_smi(report)
    versions(report, setting)
    ceilings(report, setting)
    if setting.gpu:
        name = torch.cuda.get_device_name(setting.device)
        report.headline(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
