"""The public ops `sigmoid_gate` and `delta_rule_gates`: their checks, then the Triton kernels (kernel.py, imported
only on that path, so a CPU-only install never imports triton) or the torch paths."""
from __future__ import annotations

import torch

from .._device import kernels, knobs_for, use_triton
from ..launch_config import GateKnobs
from .torch_path import delta_rule_gates_torch, sigmoid_gate_torch


def gate_knobs(device: torch.device, **given: int | None) -> GateKnobs:
    """The kernels' launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "gates", **given)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, *, block_elements: int | None = None,
                 num_warps: int | None = None) -> torch.Tensor:
    """`o * sigmoid(gate)` as a new contiguous `[T, H * D]` tensor in o's dtype (the output projection's input).

    o, gate `[T, H, D]` of one shape and dtype, any token and head strides, contiguous channels (gate a view of
    the projection: Qwen3.5's gates sit between the queries). sigmoid in float32 rounded to the dtype (as
    torch.sigmoid stores it), then the product in float32 rounded once. Tensors on CPU run sigmoid_gate_torch unless
    TRITON_INTERPRET=1. Launch knobs (Triton only; None: the launch table's row for the tensors' GPU): rows of
    whole heads, as many as fit in block_elements (a head padded to a power of two), in num_warps."""
    if o.shape != gate.shape or o.dim() != 3 or o.dtype != gate.dtype or o.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"o and gate must be [T, H, D] of one shape and dtype with contiguous channels, got "
                         f"{tuple(o.shape)} {o.dtype} and {tuple(gate.shape)} {gate.dtype}")
    if not use_triton(o):
        return sigmoid_gate_torch(o, gate)
    knobs = gate_knobs(o.device, block_elements=block_elements, num_warps=num_warps)
    return kernels("gates.kernel").sigmoid_gate_triton(o, gate, knobs)


def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                     block_tokens: int | None = None, num_warps: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of the Gated DeltaNet: `g = -exp(A_log) * softplus(a + dt_bias)` in float32 and `beta =
    sigmoid(b)` in b's dtype, each a new contiguous `[T, HV]` (what the delta-rule kernels take, after `[None]`).

    a, b `[T, HV]` (any row stride, contiguous columns: views of the input projection), A_log and dt_bias `[HV]`.
    float32 arithmetic as layers/gated_deltanet.py's ops on a GPU: a + dt_bias, exp, softplus (beta 1, threshold
    20), their product; sigmoid rounded once. Tensors on CPU run delta_rule_gates_torch unless TRITON_INTERPRET=1.
    Launch knobs (Triton only): block_tokens tokens per program (all heads), num_warps."""
    if a.dim() != 2 or a.shape != b.shape or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a and b must be [T, HV] of one shape with contiguous columns, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    T, HV = a.shape
    if A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise ValueError(f"A_log and dt_bias must be [{HV}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}")
    if not use_triton(a):
        return delta_rule_gates_torch(a, b, A_log, dt_bias)
    knobs = gate_knobs(a.device, delta_block_tokens=block_tokens, delta_num_warps=num_warps)
    return kernels("gates.kernel").delta_rule_gates_triton(a, b, A_log, dt_bias, knobs)
