"""The public op `causal_conv1d`: its checks, then the Triton kernels (kernel.py, imported only on that path, so a
CPU-only install never imports triton) or the torch path."""
from __future__ import annotations

import torch

from triton_kernels._device import kernels, knobs_for, use_triton
from triton_kernels.causal_conv.layout import check_inputs, host_layout
from triton_kernels.causal_conv.naive import naive_causal_conv1d
from triton_kernels.launch_config import CausalConvKnobs


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    block_t: int | None = None,
    block_c: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of each sequence of a ragged batch, then `activation`; returns [T, C] in x's dtype.

    x [T, C]: the sequences' tokens end to end (any row stride, contiguous channels: a column slice of a
    projection is read in place). weight [C, kernel]. cu_seqlens int32/int64 [N+1] (None: one sequence).
    conv_state [slots, kernel - 1, C]: a pool of windows, each the last kernel - 1 inputs of a sequence,
    oldest first; state_indices int [N]: sequence n's slot (-1: none). Sequence n starts from its slot's
    window when has_initial_state[n] (bool [N]; None: no sequence does), else from zeros; every sequence
    with a slot leaves its last kernel - 1 inputs there (fewer new tokens than that: the old window shifted),
    in place. Slots must be distinct. Products and sums in float32.

    Tensors on CPU run `naive_causal_conv1d` unless TRITON_INTERPRET=1. Launch knobs (Triton only):
    block_t tokens x block_c channels per program, num_warps; None takes the launch table's row for the
    tensors' GPU (triton_kernels/launch_config.py).
    """
    dims = check_inputs(x, weight, cu_seqlens, conv_state, state_indices, has_initial_state, activation)
    if x.device.type == "cpu":   # free to read here: check the values the kernels trust
        host_layout(dims, cu_seqlens, conv_state, state_indices, has_initial_state)
        if not use_triton(x):
            return naive_causal_conv1d(x, weight, cu_seqlens=cu_seqlens, conv_state=conv_state,
                                       state_indices=state_indices, has_initial_state=has_initial_state,
                                       activation=activation)
    knobs = conv_knobs(x.device, block_t=block_t, block_c=block_c, num_warps=num_warps)
    return kernels("causal_conv.kernel").causal_conv1d_triton(
        x, weight, dims, cu_seqlens, conv_state, state_indices, has_initial_state, activation is not None,
        **vars(knobs))


def conv_knobs(device: torch.device, **given: int | None) -> CausalConvKnobs:
    """The conv kernels' launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "conv", **given)
