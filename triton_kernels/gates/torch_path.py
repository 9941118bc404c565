"""The gate kernels in plain torch: the unfused ops, with the kernels' rounding points.

These are what CPU tensors run outside the interpreter. The engine's CPU path does not call them: its layers keep
pipeline/models/qwen3_5.py's and layers/gated_deltanet.py's ops (through triton_kernels.pointwise, for their
bits), whose arithmetic these follow."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """See kernel.sigmoid_gate."""
    T = o.shape[0]
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))


def delta_rule_gates_torch(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernel.delta_rule_gates."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b)
