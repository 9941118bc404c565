"""Ragged depthwise causal conv (+ SiLU) in one pass over a step's [T, C] tokens, with per-sequence windows.

Qwen3.5's delta-rule layers convolve each channel of [q|k|v] with a short causal filter (kernel 4).
Chunked prefill and decode continue a sequence from the last `kernel - 1` inputs it saw, kept in a state
slot. Two launches:
- the conv: a program per tile of tokens x channels of the flat batch; each row finds its sequence by a
  binary search of cu_seqlens, takes its taps from x (rows of its own sequence) or from the sequence's
  stored window (rows before its start, zeros for a fresh sequence), and writes act(sum) once;
- the window update: a program per (sequence, channel block) writes the last `kernel - 1` inputs of each
  sequence that has a slot into it, in place. It runs after the conv because the conv's programs read the
  old windows (a sequence shorter than the window keeps part of its old one, shifted).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launch
from triton_kernels.causal_conv.layout import ConvDims


@triton.jit
def _causal_conv_kernel(
    x, w, out,  # x [T, C] (row stride stride_x, channels contiguous); w [C, WIDTH + 1]; out [T, C]
    state, state_idx, has_init,  # window pool [slots, WIDTH, C]; slot [N] (-1: none); bool [N]; None without
    cu_seqlens,  # int32 or int64 [N+1]
    T, C, stride_x, num_seqs, search_steps,
    WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r = rows < T
    m_c = cols < C
    # The sequence of each row: the last n with cu_seqlens[n] <= row (a row past T lands on the last one).
    lo = tl.zeros([BT], dtype=tl.int32)
    hi = tl.zeros([BT], dtype=tl.int32) + (num_seqs - 1)
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        right = tl.load(cu_seqlens + mid).to(tl.int64) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    pos = rows - tl.load(cu_seqlens + lo).to(tl.int64)   # position of the row in its sequence
    if HAS_STATE:
        slot = tl.load(state_idx + lo).to(tl.int64)
        reads = (tl.load(has_init + lo) != 0) & (slot >= 0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(WIDTH + 1):   # tap weight[:, WIDTH - j] meets the input j rows back
        tap = tl.load(w + cols * (WIDTH + 1) + (WIDTH - j), mask=m_c, other=0.0).to(tl.float32)
        inside = m_r & (pos >= j)
        v = tl.load(x + (rows - j)[:, None] * stride_x + cols[None, :], mask=inside[:, None] & m_c[None, :],
                    other=0.0).to(tl.float32)
        if HAS_STATE:
            if j > 0:   # rows before the sequence's start: its stored window, oldest row first
                before = m_r & (pos < j) & reads
                s = tl.load(state + (slot * WIDTH + (WIDTH + pos - j))[:, None] * C + cols[None, :],
                            mask=before[:, None] & m_c[None, :], other=0.0).to(tl.float32)
                v += s
        acc += v * tap[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + rows[:, None] * C + cols[None, :], acc.to(out.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _conv_window_kernel(
    x, state, state_idx, has_init, cu_seqlens,  # as in _causal_conv_kernel
    C, stride_x,
    WIDTH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(state_idx + n).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        m_c = cols < C
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        length = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
        r = tl.arange(0, BW)
        reads = tl.load(has_init + n + r * 0) != 0   # as a vector: the interpreter rejects a scalar in a mask
        pos = length - WIDTH + r   # the window's rows, as positions in the sequence (negative: the old window)
        m_w = r < WIDTH
        new = tl.load(x + (bos + pos)[:, None] * stride_x + cols[None, :],
                      mask=(m_w & (pos >= 0))[:, None] & m_c[None, :], other=0.0)
        kept = tl.load(state + (slot * WIDTH + WIDTH + pos)[:, None] * C + cols[None, :],
                       mask=(m_w & (pos < 0) & reads)[:, None] & m_c[None, :], other=0.0)
        window = tl.where((pos >= 0)[:, None], new.to(state.dtype.element_ty), kept)
        tl.debug_barrier()   # every thread has read the old window before any overwrites it (rows shift)
        tl.store(state + (slot * WIDTH + r)[:, None] * C + cols[None, :], window, mask=m_w[:, None] & m_c[None, :])


def _power_of_two(name: str, value: int, least: int) -> int:
    if value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
    return value


def causal_conv1d_triton(x, weight, dims: ConvDims, cu_seqlens, conv_state, state_indices, has_initial_state,
                         silu: bool, *, block_t: int, block_c: int, num_warps: int) -> torch.Tensor:
    """op.causal_conv1d's Triton launches: the conv, then the window update; arguments already checked."""
    T, C, width, N = dims.num_tokens, dims.channels, dims.width, dims.num_sequences
    BT, BC = _power_of_two("block_t", block_t, 1), _power_of_two("block_c", block_c, 16)
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=x.device)
    cu_seqlens = cu_seqlens.contiguous()
    weight = weight.contiguous()
    if conv_state is not None:
        state_indices = state_indices.contiguous()
        if has_initial_state is None:
            has_initial_state = torch.zeros(N, dtype=torch.bool, device=x.device)
    if T:
        launch(_causal_conv_kernel, (triton.cdiv(T, BT), triton.cdiv(C, BC)),
               x, weight, out, conv_state, state_indices, has_initial_state, cu_seqlens,
               T, C, x.stride(0), N, max(N - 1, 0).bit_length(),
               WIDTH=width, BT=BT, BC=BC, HAS_STATE=conv_state is not None, SILU=silu, num_warps=num_warps)
    if conv_state is not None and width:
        launch(_conv_window_kernel, (N, triton.cdiv(C, BC)),
               x, conv_state, state_indices, has_initial_state, cu_seqlens, C, x.stride(0),
               WIDTH=width, BW=triton.next_power_of_2(width), BC=BC, num_warps=num_warps)
    return out
