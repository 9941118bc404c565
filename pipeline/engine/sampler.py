"""Next-token choice: greedy, or temperature + top-p sampling driven by a counter-based random stream.

Each sequence's random numbers are a pure function of (run seed, sequence key, token index): splitmix64
of the three, so a sequence samples the same tokens whichever worker, batch or step it lands in (given
the same logits) and no generator state has to be carried or checkpointed.
"""
from __future__ import annotations

import numpy as np
import torch

_M64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = (z + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 in [0, 1), one per (key, step), for the run `seed`."""
    with np.errstate(over="ignore"):
        z = _splitmix64(np.full(len(keys), seed & _M64, np.uint64))
        z = _splitmix64(z ^ np.asarray(keys, np.uint64))
        z = _splitmix64(z ^ np.asarray(steps, np.uint64))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: np.ndarray) -> torch.Tensor:
    """Token ids [S] from logits [S, V]: argmax when temperature == 0, else the inverse CDF at u of the
    tempered distribution restricted to its top-p nucleus (the smallest prefix of tokens by decreasing
    probability whose mass reaches top_p)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        before = sorted_probs.cumsum(dim=-1) - sorted_probs       # mass of the tokens ranked above
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    cdf = sorted_probs.double().cumsum(dim=-1)
    target = torch.from_numpy(u).to(cdf.device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    return order.gather(1, pick).squeeze(1)
