"""Seeded random weights by parameter role, large enough that outputs are far from degenerate (transformers'
0.02 init leaves tiny models near-uniform, see tests/tiny_checkpoints.py): matrices with unit-variance
outputs, norms near 1, small random biases, decay parameters in a working range."""
from __future__ import annotations

import math
import zlib

import torch


def seed_of(name: str) -> int:
    """A stable seed per family name (crc32: the same on every machine and Python version)."""
    return zlib.crc32(name.encode())


def _is_norm(name: str) -> bool:
    """LayerNorm/RMSNorm scales: "...norm...", and GPT-2's ln_1 / ln_2 / ln_f."""
    return "norm" in name.lower() or any(part.startswith("ln_") for part in name.split("."))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter of `model` drawn from a CPU generator seeded with `seed`, in name order."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("A_log"):                                   # Gated DeltaNet decay rates in [1, 16)
            value = torch.log(1.0 + 15.0 * torch.rand(param.shape, generator=generator))
        elif name.endswith("dt_bias"):
            value = 1.0 + 0.1 * noise
        elif param.dim() == 1 and _is_norm(name) and name.endswith("weight"):
            value = 1.0 + 0.1 * noise
        elif param.dim() == 1:                                       # biases
            value = 0.1 * noise
        else:                                                        # matrices, embeddings, convolutions
            value = noise / math.sqrt(param.shape[-1])
        param.copy_(value.to(param.dtype))
