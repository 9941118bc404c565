"""The gated MLP of Llama-style blocks. gate and up projections are stored as one weight; on a GPU they run as
one matmul, on a CPU as two matmuls on that weight's halves (see `CPU_SPLIT_GATE_UP`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_kernels import pointwise
from triton_kernels.rms_norm import silu_mul

from .linear import Linear, linear

# On CPU, run gate and up as two matmuls over views of the fused weight. In bfloat16 the 1/8 Qwen3.5's MLPs
# took 207-233 ms per pass of 2,500-2,900 tokens this way against 275-296 fused (whose [T, 2I] output and
# strided halves fall out of cache), and about the same at 4,000 tokens; in float32 they are GEMM-bound
# either way. `bench/profile_cpu_layers.py --mlp-fused` measures the fused form.
CPU_SPLIT_GATE_UP = True


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; `gate_up` holds gate_proj's rows then up_proj's (see `load`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias)
        self.down = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not CPU_SPLIT_GATE_UP:
            gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
            return self.down(F.silu(gate, inplace=True).mul_(up))   # in place in gate_up's output: no new tensors
        w, b, n = self.gate_up.weight, self.gate_up.bias, self.intermediate
        gate = linear(x, w[:n], None if b is None else b[:n])   # row slices of the weight: contiguous views
        up = linear(x, w[n:], None if b is None else b[n:])
        return self.down(pointwise.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton path's form: silu(gate) * up in one pass over the gate_up product (triton_kernels.rms_norm
        silu_mul, with forward's GPU rounding points), written contiguous for the down product."""
        return self.down(silu_mul(self.gate_up(x)))

    def load(self, tensors, prefix: str) -> None:
        """Weights from a checkpoint's `{prefix}gate_proj`, `up_proj`, `down_proj`."""
        self.gate_up.weight.copy_(torch.cat([tensors.get(f"{prefix}gate_proj.weight"),
                                             tensors.get(f"{prefix}up_proj.weight")]))
        self.down.weight.copy_(tensors.get(f"{prefix}down_proj.weight"))
        if self.gate_up.bias is not None:
            self.gate_up.bias.copy_(torch.cat([tensors.get(f"{prefix}gate_proj.bias"),
                                               tensors.get(f"{prefix}up_proj.bias")]))
            self.down.bias.copy_(tensors.get(f"{prefix}down_proj.bias"))
