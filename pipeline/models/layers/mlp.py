"""The gated MLP of Llama-style blocks, with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; `gate_up` holds gate_proj's rows then up_proj's (see `fuse`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate, inplace=True).mul_(up))   # in place in gate_up's output: no new tensors

    def load(self, tensors, prefix: str) -> None:
        """Weights from a checkpoint's `{prefix}gate_proj`, `up_proj`, `down_proj`."""
        self.gate_up.weight.copy_(torch.cat([tensors.get(f"{prefix}gate_proj.weight"),
                                             tensors.get(f"{prefix}up_proj.weight")]))
        self.down.weight.copy_(tensors.get(f"{prefix}down_proj.weight"))
        if self.gate_up.bias is not None:
            self.gate_up.bias.copy_(torch.cat([tensors.get(f"{prefix}gate_proj.bias"),
                                               tensors.get(f"{prefix}up_proj.bias")]))
            self.down.bias.copy_(tensors.get(f"{prefix}down_proj.bias"))
