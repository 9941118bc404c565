"""Checks on a causal conv call's tensors, and its sequences and slots read on the host (CPU tensors only).

A GPU call is checked for shapes and dtypes only: reading cu_seqlens or the slots there would sync the
device, so the kernels trust their values (the engine builds them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ConvDims:
    num_tokens: int
    channels: int
    width: int             # stored inputs per sequence: kernel size - 1
    num_sequences: int


def check_inputs(x, weight, cu_seqlens, conv_state, state_indices, has_initial_state, activation) -> ConvDims:
    """Shapes, dtypes and devices of a call (see causal_conv1d's docstring)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with contiguous channels, got shape {tuple(x.shape)} strides {x.stride()}")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C={C}, kernel], got {tuple(weight.shape)}")
    width = weight.shape[1] - 1
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if cu_seqlens is None:
        N = 1
    else:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64 [N+1], N >= 1, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        N = cu_seqlens.shape[0] - 1
    if (state_indices is None) != (conv_state is None):
        raise ValueError("conv_state and state_indices go together")
    if has_initial_state is not None and state_indices is None:
        raise ValueError("has_initial_state needs conv_state and state_indices")
    if conv_state is not None:
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (width, C) or not conv_state.is_contiguous():
            raise ValueError(f"conv_state must be a contiguous [slots, {width}, {C}] pool, got "
                             f"{tuple(conv_state.shape)}")
        if state_indices.shape != (N,) or state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state_indices must be int32 or int64 [{N}], got {state_indices.dtype} "
                             f"{tuple(state_indices.shape)}")
        if has_initial_state is not None and (has_initial_state.shape != (N,) or has_initial_state.dtype != torch.bool):
            raise ValueError(f"has_initial_state must be bool [{N}], got {has_initial_state.dtype} "
                             f"{tuple(has_initial_state.shape)}")
    for name, t in (("weight", weight), ("cu_seqlens", cu_seqlens), ("conv_state", conv_state),
                    ("state_indices", state_indices), ("has_initial_state", has_initial_state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return ConvDims(T, C, width, N)


def host_layout(dims: ConvDims, cu_seqlens, conv_state, state_indices, has_initial_state):
    """(bounds [N+1], slots [N] (-1: none), reads [N]) as Python lists, their values checked."""
    T, N = dims.num_tokens, dims.num_sequences
    bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the token count {T}")
    slots = [-1] * N if state_indices is None else [int(s) for s in state_indices.tolist()]
    reads = [False] * N if has_initial_state is None else [bool(r) for r in has_initial_state.tolist()]
    used = [s for s in slots if s >= 0]
    if conv_state is not None and any(s >= conv_state.shape[0] for s in used):
        raise ValueError(f"state_indices must be < {conv_state.shape[0]} (the pool's slots) or -1")
    if len(set(used)) != len(used):
        raise ValueError("two sequences share a state slot")
    if any(r and s < 0 for r, s in zip(reads, slots)):
        raise ValueError("a sequence with has_initial_state needs a state slot (state_indices >= 0)")
    return bounds, slots, reads
