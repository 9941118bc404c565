#!/usr/bin/env python3
"""Costs of the single CPU ops behind choices in the native engine's CPU path, 1 thread.

    python bench/cpu_op_costs.py

- float32 exp per element by argument: torch's vectorised exp leaves its fast path when the result is
  denormal or underflows (arguments below about -87.3), which is why torch_path clamps exp arguments to
  EXP_RANGE first.
- the conv's per-tap `addcmul` on a 4000 x 1536 step (the 1/8 Qwen3.5's conv channels) with the tap's
  weights as a strided column of the [C, kernel] weight or as a contiguous row, which is why the conv
  transposes its weights once per call.
- (I + strict_lower(A))^-1 for batches of C x C: LAPACK's batched triangular solve, which torch_path
  uses, against the blocked nilpotent series of batched matmuls it used before (kept here as
  `series_inverse` for the comparison).
- the delta rule alone by chunk size, on random inputs (12 sequences of 330 tokens) with heads the
  engine models do not have on CPU here: 8 of 32 and Qwen3.5-0.8B's 16 of 128, for CPU_CHUNK_SIZE.
- RMS norms: torch's fused rms_norm against a vector_norm over the same rows (and layer_norm for
  scale), which is why pipeline.models.layers.norms.rms_normalise builds the norm from vector_norm on CPU;
  and a bfloat16 norm module over a whole tensor against blocks of rows (norms.CPU_BLOCK_BYTES).
Each timing is the best of 5 repeats of 10 calls, after warm-up, denormals flushed as workers do.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.worker.cpu_setup import keep_freed_memory, set_cpu_threads  # noqa: E402
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


def series_inverse(A: torch.Tensor, block: int = 16) -> torch.Tensor:
    """torch_path's earlier (I + strict_lower(A))^-1: each b x b diagonal block's strict lower part L is
    nilpotent, so its inverse is (I - L)(I + L^2)(I + L^4)(I + L^8); block row i is then
    -T_ii A_i,<i T_<i,<i."""
    C = A.shape[-1]
    b = min(block, C)
    Cp = -(-C // b) * b
    A = torch.nn.functional.pad(A.tril(-1), (0, Cp - C, 0, Cp - C))
    nb = Cp // b
    L = torch.stack([A[..., i * b:(i + 1) * b, i * b:(i + 1) * b] for i in range(nb)], dim=-3)
    diag_inv = torch.eye(b, dtype=A.dtype) - L
    power, span = L @ L, 2
    while span < b:
        diag_inv = diag_inv + diag_inv @ power
        span *= 2
        if span < b:
            power = power @ power
    T = A.new_zeros(A.shape)
    for i in range(nb):
        r0, r1 = i * b, (i + 1) * b
        T[..., r0:r1, r0:r1] = diag_inv[..., i, :, :]
        if i:
            T[..., r0:r1, :r0] = -diag_inv[..., i, :, :] @ (A[..., r0:r1, :r0] @ T[..., :r0, :r0])
    return T[..., :C, :C]


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

    from triton_kernels.gated_delta_rule.torch_path import invert_unit_lower
    print("\n| (I + strict_lower(A))^-1, batch x C^2 float32 | triangular solve (us) | matmul series (us) |"
          "\n| --- | ---: | ---: |")
    for batch, C in ((88, 32), (1056, 32), (4096, 8), (1056, 16), (528, 64)):
        A = torch.randn(batch, C, C) * 0.3
        assert torch.allclose(invert_unit_lower(A), series_inverse(A), atol=1e-4)
        print(f"| {batch} x {C}^2 | {best_ms(lambda: invert_unit_lower(A)) * 1e3:.0f} | "
              f"{best_ms(lambda: series_inverse(A)) * 1e3:.0f} |")

    from triton_kernels import chunk_gated_delta_rule
    print("\n| delta rule, 12 x 330 tokens, float32 | chunk 8 (ms) | 16 | 32 | 64 |\n| --- | ---: | ---: | ---: | ---: |")
    for H, K in ((8, 32), (16, 128)):
        gen = torch.Generator().manual_seed(0)
        T = 12 * 330
        q, k, v = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
        g, beta = -torch.rand(1, T, H, generator=gen) * 0.5, torch.rand(1, T, H, generator=gen)
        cu = torch.arange(0, T + 1, 330)
        row = [best_ms(lambda: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                                      chunk_size=c), repeats=3, calls=2) for c in (8, 16, 32, 64)]
        print(f"| {H} heads of {K} | " + " | ".join(f"{t:.1f}" for t in row) + " |")

    print("\n| float32 norm over rows, 2M elements | 4000 x 512 (ms) | 32000 x 64 (ms) |\n| --- | ---: | ---: |")
    shapes = [(4000, 512), (32000, 64)]
    xs = [torch.randn(*s) for s in shapes]
    ws = [torch.randn(s[1]) for s in shapes]
    for name, fn in (("torch rms_norm (fused)", lambda x, w: torch.nn.functional.rms_norm(x, x.shape[-1:], w, 1e-6)),
                     ("vector_norm of each row only", lambda x, w: torch.linalg.vector_norm(x, dim=-1)),
                     ("rms_normalise (vector_norm, then scale)", lambda x, w: rms_normalise(x, 1e-6, w)),
                     ("torch layer_norm (fused)", lambda x, w: torch.nn.functional.layer_norm(x, x.shape[-1:], w, w))):
        print(f"| {name} | " + " | ".join(f"{best_ms(lambda: fn(x, w)):.2f}" for x, w in zip(xs, ws)) + " |")

    import pipeline.models.layers.norms as norms
    print("\n| Qwen3.5 input norm (RMSNorm, zero-centred), bfloat16 | 2859 x 512 (ms) | 4000 x 512 (ms) |\n"
          "| --- | ---: | ---: |")
    norm = norms.RMSNorm(512, 1e-6, zero_centred=True)
    xs = [torch.randn(rows, 512).bfloat16() for rows in (2859, 4000)]
    blocked = norms.CPU_BLOCK_BYTES
    for name, block_bytes in (("whole tensor", 1 << 40), ("blocks of 128 KiB of float32", 128 << 10),
                              (f"blocks of {blocked >> 10} KiB (CPU_BLOCK_BYTES)", blocked), ("blocks of 2 MiB", 2 << 20)):
        norms.CPU_BLOCK_BYTES = block_bytes
        print(f"| {name} | " + " | ".join(f"{best_ms(lambda: norm(x)):.2f}" for x in xs) + " |")
    norms.CPU_BLOCK_BYTES = blocked


if __name__ == "__main__":
    main()
