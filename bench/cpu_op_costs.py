#!/usr/bin/env python3
"""Costs of the single CPU ops behind choices in the native engine's CPU path, 1 thread.

    python bench/cpu_op_costs.py

- float32 exp per element by argument: torch's vectorised exp leaves its fast path when the result is
  denormal or underflows (arguments below about -87.3), which is why torch_path clamps exp arguments to
  EXP_RANGE first.
- the conv's per-tap `addcmul` on a 4000 x 1536 step (the 1/8 Qwen3.5's conv channels) with the tap's
  weights as a strided column of the [C, kernel] weight or as a contiguous row, which is why the conv
  transposes its weights once per call.
- RMS norms: torch's fused rms_norm against a vector_norm over the same rows (and layer_norm for
  scale), which is why pipeline.models.layers.norms.rms_normalise builds the norm from vector_norm on CPU.
Each timing is the best of 5 repeats of 10 calls, after warm-up, denormals flushed as workers do.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.devices import keep_freed_memory, set_cpu_threads  # noqa: E402
from pipeline.models.layers.norms import rms_normalise  # noqa: E402


def best_ms(fn, repeats: int = 5, calls: int = 10) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    set_cpu_threads(1)
    keep_freed_memory()
    n = 1 << 20
    print(f"torch {torch.__version__}, 1 thread\n")
    print("| float32 exp, argument | ns per element |\n| --- | ---: |")
    for arg in (-1.0, -80.0, -87.0, -88.0, -95.0, -104.0, -200.0):
        x = torch.full((n,), arg)
        out = torch.empty_like(x)
        print(f"| {arg:g} | {best_ms(lambda: torch.exp(x, out=out)) * 1e6 / n:.2f} |")
    x = torch.full((n,), -200.0)
    out = torch.empty_like(x)
    clamped = best_ms(lambda: torch.exp(out.copy_(x).clamp_(-87.0, 88.0), out=out)) * 1e6 / n
    print(f"| -200, clamped to [-87, 88] first (copy + clamp + exp) | {clamped:.2f} |")

    T, C, kernel = 4000, 1536, 4
    x, out = torch.randn(T, C), torch.empty(T, C)
    w = torch.randn(C, kernel)
    rows = w.T.contiguous()
    print("\n| conv tap: out.addcmul_(x, w) on 4000 x 1536 | ms |\n| --- | ---: |")
    print(f"| w a strided column of the [C, kernel] weight | {best_ms(lambda: out.addcmul_(x, w[:, 2])):.2f} |")
    print(f"| w a contiguous row of its transpose | {best_ms(lambda: out.addcmul_(x, rows[2])):.2f} |")

    print("\n| float32 norm over rows, 2M elements | 4000 x 512 (ms) | 32000 x 64 (ms) |\n| --- | ---: | ---: |")
    shapes = [(4000, 512), (32000, 64)]
    xs = [torch.randn(*s) for s in shapes]
    ws = [torch.randn(s[1]) for s in shapes]
    for name, fn in (("torch rms_norm (fused)", lambda x, w: torch.nn.functional.rms_norm(x, x.shape[-1:], w, 1e-6)),
                     ("vector_norm of each row only", lambda x, w: torch.linalg.vector_norm(x, dim=-1)),
                     ("rms_normalise (vector_norm, then scale)", lambda x, w: rms_normalise(x, 1e-6, w)),
                     ("torch layer_norm (fused)", lambda x, w: torch.nn.functional.layer_norm(x, x.shape[-1:], w, w))):
        print(f"| {name} | " + " | ".join(f"{best_ms(lambda: fn(x, w)):.2f}" for x, w in zip(xs, ws)) + " |")


if __name__ == "__main__":
    main()
