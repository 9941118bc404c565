"""Probe two numerical differences between the GPU and the Triton interpreter that the first GPU acceptance run
showed (bench/gpu_acceptance.sh, H200, 2026-11-26), and print what it finds:

1. T5's relative-position buckets: the float64 formula's quotient is an integer at some distances (16, 32, 64
   for 32 buckets and distance 128); is CUDA's log there the integer, as the CPU's is, and do transformers'
   own float32 buckets on CUDA equal its CPU ones?
2. The gated delta rule's chunk kernel with extreme gates (tests/kernels/test_gated_delta_rule.py): its error
   against the float64 recurrence, where in the sequence it sits, with the gates clipped to where exp never
   goes subnormal, beside the torch path on the same GPU and the floor of any chunked float32 method (the
   recurrence fed the gates as float32 chunk sums see them).

    python tools/gpu_numerics_probe.py        # on a machine with a CUDA GPU, from the checkout's root
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.test_gated_delta_rule import float32_gamma_floor, make_inputs, rel_rms  # noqa: E402
from triton_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from triton_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402


def t5_buckets_probe(device: str) -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    for a in (16, 32, 64):
        quotient = {d: (torch.log(torch.tensor(a / 8, dtype=torch.float64, device=d)) / math.log(128 / 8)
                        * 8).item() for d in ("cpu", device)}
        print(f"T5 32 buckets, distance {a}: float64 log quotient cpu {quotient['cpu']!r} {device} "
              f"{quotient[device]!r}")
    offsets = torch.arange(-3000, 3001)
    for num_buckets, max_distance in ((32, 128), (64, 128)):
        cpu = T5Attention._relative_position_bucket(offsets, True, num_buckets, max_distance)
        gpu = T5Attention._relative_position_bucket(offsets.to(device), True, num_buckets, max_distance).cpu()
        differ = (cpu != gpu).nonzero().flatten()
        print(f"transformers' buckets ({num_buckets}, {max_distance}) on {device} vs cpu: {differ.numel()} of "
              f"{offsets.numel()} offsets differ{': ' + str(offsets[differ][:12].tolist()) if differ.numel() else ''}")


def delta_probe(device: str) -> None:
    from triton_kernels._device import torch_path_on_cpu

    base = make_inputs(1, 150, 1, 2, 32, 32, gates="extreme", num_states=1, seed=3, device=device)
    variants = {"extreme (the test's)": base,
                "gates clipped at -60": {**base, "g": base["g"].clamp(min=-60.0)},
                "normal gates": make_inputs(1, 150, 1, 2, 32, 32, num_states=1, seed=3, device=device)}
    for name, inputs in variants.items():
        ref_o, ref_s = naive_recurrent_gated_delta_rule(**inputs, output_final_state=True)
        floor_o, _ = naive_recurrent_gated_delta_rule(**float32_gamma_floor(inputs, 64), output_final_state=True)
        o, s = chunk_gated_delta_rule(**inputs, output_final_state=True)
        o_bi, _ = chunk_gated_delta_rule(**inputs, output_final_state=True, batch_invariant=True)
        o128, _ = chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=128)
        o_rec, _ = fused_recurrent_gated_delta_rule(**inputs, output_final_state=True, block_v=32)
        cpu_inputs = {k: v.cpu() if torch.is_tensor(v) else v for k, v in inputs.items()}
        with torch_path_on_cpu():
            o_torch, _ = chunk_gated_delta_rule(**cpu_inputs, output_final_state=True)
        per_chunk = [f"{rel_rms(o[:, a:a + 64], ref_o[:, a:a + 64]):.1e}" for a in range(0, 150, 64)]
        print(f"delta rule, {name}: chunk kernel o {rel_rms(o, ref_o):.2e} (by chunk {per_chunk}) state "
              f"{rel_rms(s, ref_s):.2e}; batch_invariant {rel_rms(o_bi, ref_o):.2e}; chunk 128 "
              f"{rel_rms(o128, ref_o):.2e}; recurrent kernel {rel_rms(o_rec, ref_o):.2e}; torch path (CPU) "
              f"{rel_rms(o_torch, ref_o.cpu()):.2e}; float32-gamma floor {rel_rms(floor_o, ref_o):.2e}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("gpu_numerics_probe: no CUDA GPU visible")
    t5_buckets_probe("cuda")
    delta_probe("cuda")
