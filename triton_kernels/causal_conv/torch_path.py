"""The ragged causal conv (+ SiLU) as CPU tensors run it: float32 shifted slices, one pass per tap.

Shifting the step's flat input x by j rows hands every token its input j rows back. That is right except
in the first `width` rows of each sequence, where the shift reads the previous sequence's tokens (or nothing,
before row 0) instead of the sequence's own stored window (or zeros, for a fresh sequence); those few
(row, shift) pairs are fixed up before the SiLU. `conv_index` finds them once per step (every layer of the
step shares it); `causal_conv1d_torch` runs the conv. naive.py states the semantics, kernel.py is the GPU path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from triton_kernels import pointwise

# Rows per block: 64 rows of a 1536-channel projection (the 1/8 Qwen3.5) are 384 KiB, so the four taps run
# in L2. Per layer on a 4k-token batch (bench/profile_cpu_layers.py --conv-block-rows N, three runs each):
# 13.4-13.6 ms in blocks of 64, 18.3-19.3 ms unblocked.
CPU_CONV_BLOCK_ROWS = 64


@dataclass(frozen=True)
class ConvIndex:
    """Host index arrays of one step's conv. Sources are codes into x and a small table `extra = [zero row;
    stored windows of the reading sequences, width rows each, oldest first]`: code c >= 0 is row c of x, c < 0
    is row -1 - c of extra."""
    rows: np.ndarray            # int64 [M], ascending: rows whose shifted input is wrong for some tap
    shifts: np.ndarray          # int64 [M]: that tap
    wrong: np.ndarray           # int64 [M]: what the shift reads (-1: nothing)
    right: np.ndarray           # int64 [M]: the source it should read
    window: np.ndarray | None   # int64 [W, width]: the last `width` inputs of each sequence whose window is kept
    direct_rows: np.ndarray | None = None   # batch-invariant: the distinct fixed rows, ascending
    direct_codes: np.ndarray | None = None  # and per row the source of every tap ([:, j]: the input j rows back)


def conv_index(q_lens: np.ndarray, read_seqs: np.ndarray | None, write_seqs: np.ndarray | None, width: int,
               batch_invariant: bool) -> ConvIndex:
    """The fix-ups of a step of sequences with `q_lens` new tokens each, of which `read_seqs` continue a
    stored window and `write_seqs` keep theirs. With `batch_invariant`, the fixed rows are recomputed from
    their own sources (direct_rows / direct_codes) instead of corrected: a correction would add its rounding,
    which depends on the sequence before."""
    S, q_lens = len(q_lens), np.asarray(q_lens, np.int64)
    starts = np.zeros(S, np.int64)
    np.cumsum(q_lens[:-1], out=starts[1:])
    read_pos = np.full(S, -1, np.int64)
    if read_seqs is not None:
        read_pos[read_seqs] = np.arange(len(read_seqs))

    def source(seq, p):
        """Code of the input at position p (negative: before this step) of sequence seq."""
        before = np.where(read_pos[seq] >= 0, -2 - (read_pos[seq] * width + width + p), -1)
        return np.where(p >= 0, starts[seq] + p, before)

    first, shift = np.triu_indices(width + 1, 1)    # every row i < width of a sequence, shifts j > i
    seq = np.repeat(np.arange(S), len(first))
    i, j = np.tile(first, S), np.tile(shift, S)
    keep = i < q_lens[seq]
    seq, i, j = seq[keep], i[keep], j[keep]
    rows = starts[seq] + i
    wrong = np.where(rows >= j, rows - j, -1)
    right = source(seq, i - j)
    differ = wrong != right
    window = None
    if write_seqs is not None:
        wseq = np.asarray(write_seqs)[:, None]
        window = source(wseq, q_lens[wseq] - width + np.arange(width)[None, :])
    index = ConvIndex(rows[differ], j[differ], wrong[differ], right[differ], window)
    if not batch_invariant or not len(index.rows):
        return index
    fixed, at = np.unique(index.rows, return_inverse=True)
    codes = fixed[:, None] - np.arange(width + 1)[None, :]
    codes[codes < 0] = -1
    codes[at, index.shifts] = index.right
    return ConvIndex(index.rows, index.shifts, index.wrong, index.right, window, fixed, codes)


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, index: ConvIndex, *, conv_state: torch.Tensor,
                        read_slots: torch.Tensor | None, write_slots: torch.Tensor | None,
                        batch_invariant: bool, block_rows: int | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU of x `[T, C]` with `weight` `[C, width + 1]`, each sequence's stored window
    (`conv_state[read_slots]`, `[slots, width, C]`) in front; the kept sequences' last `width` inputs are
    written to `conv_state[write_slots]` (read before any is overwritten). Computed in float32 a block of rows
    at a time (one pass per tap, no gather of x); returns float32 on CPU, where the delta rule computes in
    float32 anyway, x's dtype elsewhere."""
    width, C, T = weight.shape[1] - 1, x.shape[1], x.shape[0]
    device = x.device
    parts = [x.new_zeros(1, C)]
    if read_slots is not None:
        parts.append(conv_state[read_slots].reshape(-1, C).to(x.dtype))
    extra = torch.cat(parts)

    def gather(codes: np.ndarray) -> torch.Tensor:
        codes = torch.from_numpy(np.ascontiguousarray(codes)).to(device)
        return torch.where((codes >= 0)[:, None], x[codes.clamp(min=0)], extra[(-1 - codes).clamp(min=0)])

    if index.window is not None:   # read every stored window before any is overwritten
        kept = gather(index.window.ravel()).view(-1, width, C)
        conv_state[write_slots] = kept.to(conv_state.dtype)
    # Taps as contiguous rows [kernel, C]: a strided weight column made each tap ~3x slower.
    w = weight.float().T.contiguous()
    rows, fix = index.rows, None
    if len(rows) and batch_invariant:   # the fixed rows from their own inputs, in the main loop's order
        codes = index.direct_codes
        fix = gather(codes[:, 0]).float().mul_(w[width])
        for j in range(1, width + 1):
            fix.addcmul_(gather(codes[:, j]).float(), w[width - j])
        rows = index.direct_rows
    elif len(rows):   # out[row] += w[shift] * (right - wrong), added block by block before the SiLU
        shifts = torch.from_numpy(index.shifts).to(device)
        fix = (gather(index.right).float() - gather(index.wrong).float()).mul_(w[width - shifts])
    fix_rows = torch.from_numpy(rows).to(device) if fix is not None else None
    on_cpu = device.type == "cpu"
    block = (block_rows or CPU_CONV_BLOCK_ROWS) if on_cpu else T
    out = torch.empty(T, C, dtype=torch.float32, device=device)
    # 16-bit inputs are converted a block (plus the width rows before it) at a time, in cache.
    scratch = None if x.dtype == torch.float32 else x.new_empty(min(T, block + width), C, dtype=torch.float32)
    for r0 in range(0, T, block):   # on CPU, blocks of rows that stay in cache across the taps
        r1, s0 = min(T, r0 + block), max(0, r0 - width)
        src = x[s0:r1] if scratch is None else scratch[:r1 - s0].copy_(x[s0:r1])   # src[i] is x[s0 + i]
        torch.mul(src[r0 - s0:], w[width], out=out[r0:r1])
        for j in range(1, width + 1):
            a = max(r0, j)
            if a < r1:
                out[a:r1].addcmul_(src[a - j - s0:r1 - j - s0], w[width - j])
        if fix is not None:
            lo, hi = np.searchsorted(rows, (r0, r1))
            if hi > lo and batch_invariant:
                out.index_copy_(0, fix_rows[lo:hi], fix[lo:hi])
            elif hi > lo:
                out.index_add_(0, fix_rows[lo:hi], fix[lo:hi])
        pointwise.silu_(out[r0:r1])
    return out if on_cpu else out.to(x.dtype)
