"""Launch knobs of the causal conv kernels per GPU generation, in the shape of triton_kernels/launch_config.py.

Kept here until launch_config.TABLE gets a `conv` part. The rows were compiled as the compile matrix
compiles every launch (triton_kernels.aot at Qwen3.5-0.8B's shapes, bf16 and fp16, sm_80 and sm_90).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from triton_kernels._device import target_of


@dataclass(frozen=True)
class CausalConvKnobs:
    """block_t rows (tokens) x block_c channels per program of the conv; block_c channels per program of the
    state update; num_warps of both. Powers of two (block_t >= 1, block_c >= 16)."""

    block_t: int
    block_c: int
    num_warps: int


# The conv is a memory-bound stream over [T, C]: a program takes 32 tokens x 128 channels (rows of 256
# bytes in 16-bit), 16 elements per thread in 8 warps, and reads each input row once from memory (the
# other three taps hit L1): 1,024 x 48 programs for a 32k-token step of Qwen3.5-0.8B (6,144 channels),
# 8 x 48 for 256 decoding sequences. Compiled with Triton 3.9 at those shapes (bf16 and fp16): 48-60
# registers on sm_80 and 64-108 on sm_90, no spills, no shared memory. 64 x 128 in 4 warps (64 elements
# per thread) spilled 72-160 B on sm_90 where sequences read stored windows.
CONV_TABLE: dict[int, CausalConvKnobs] = {
    80: CausalConvKnobs(block_t=32, block_c=128, num_warps=8),
    90: CausalConvKnobs(block_t=32, block_c=128, num_warps=8),
}


def conv_knobs(device: torch.device, **given: int | None) -> CausalConvKnobs:
    """The conv's launch knobs for `device`: its GPU's row, with the knobs given (not None) instead."""
    arch = target_of(device).arch   # the nearest row at or below the GPU's capability, as in launch_config
    row = CONV_TABLE[max((a for a in CONV_TABLE if a <= arch), default=min(CONV_TABLE))]
    return replace(row, **{name: value for name, value in given.items() if value is not None})
