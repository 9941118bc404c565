"""The obviously correct ragged causal conv: one sequence at a time, its stored window in front.

Slow on purpose (a Python loop over sequences, one product per tap): the statement of the semantics the
kernel and the torch path (torch_path.py, what CPU tensors run) are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_kernels.causal_conv.layout import check_inputs, host_layout


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Same arguments and state update as `causal_conv1d`; computed in `dtype` and returned in x's dtype.

    Per sequence n with window w (its slot's `width` stored inputs if has_initial_state[n], else zeros)
    and inputs x_0..x_{L-1}: with u = [w; x], out_t = act(sum_k weight[:, k] * u[t + k]), and the slot
    keeps the last `width` rows of u.
    """
    dims = check_inputs(x, weight, cu_seqlens, conv_state, state_indices, has_initial_state, activation)
    bounds, slots, reads = host_layout(dims, cu_seqlens, conv_state, state_indices, has_initial_state)
    T, C, width = dims.num_tokens, dims.channels, dims.width
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    taps = weight.to(dtype)
    for n, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        window = torch.zeros(width, C, dtype=dtype, device=x.device)
        if reads[n]:
            window = conv_state[slots[n]].to(dtype)
        u = torch.cat([window, x[bos:eos].to(dtype)])            # [width + L, C]
        y = torch.zeros(eos - bos, C, dtype=dtype, device=x.device)
        for k in range(width + 1):
            y += taps[:, k] * u[k:k + eos - bos]
        out[bos:eos] = (y if activation is None else F.silu(y)).to(x.dtype)
        if slots[n] >= 0:
            conv_state[slots[n]] = u[u.shape[0] - width:].to(conv_state.dtype)
    return out
