"""How the chunked delta rule's walk covers the GPU, and the tables its launches read.

The walk (chunk.py) runs one program per (sequence, value head, block of V columns) and carries the state
through the sequence's chunks in order, so few sequences leave SMs idle. `plan_walk` first narrows the V
blocks (down to the launch table's `min_block_v`) and only then cuts long sequences into segments walked in
parallel (`walk_segment_tokens`; the segments' start states are chained afterwards, see
chunk._segmented_walk). `launch_tables` builds the int32 tables every launch of a call needs on the host,
from the sequence bounds the host already knows, and sends them in one copy that does not make the host wait
(pinned memory, non_blocking), cached per layout so the layers of one engine step share them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton

from triton_kernels.gated_delta_rule.layout import SequenceLayout

# A sequence's walk is split into segments only down to this many tokens.
MIN_SEGMENT_TOKENS = 1024
# Segmenting walks three times (the segments' local states and their transitions, then the outputs), each over
# 1/J of the sequence, so it pays only with J >= this many segments, all in one wave of the GPU.
MIN_SEGMENTS = 4


@dataclass(frozen=True)
class WalkPlan:
    """block_v: V columns per walk program. segment: tokens per segment (a multiple of the chunk size), or None
    to walk whole sequences. pieces: segments per sequence (every sequence is cut into as many, the ones past
    a shorter sequence's end empty), 1 without segments."""

    block_v: int
    segment: int | None
    pieces: int


def plan_walk(lengths: list[int], num_v_heads: int, head_v_dim: int, chunk_size: int, *, block_v: int,
              min_block_v: int, num_sms: int, batch_invariant: bool = False) -> WalkPlan:
    """The walk's V blocks and segments for sequences of these lengths on a GPU of `num_sms` SMs.

    block_v is the widest V block (fewest redundant loads of q, k, w, p per column block); it is halved, down
    to min_block_v, while the walk leaves SMs idle and the halved one still runs as one wave of one program
    per SM: 1 x 16k tokens at 32 value heads of 128 walk in blocks of 32 (128 programs on an H100's 132
    SMs, as fla's state kernel picks), a lone sequence at 16 heads in blocks of 16 (128). Sequences are then
    cut into segments when even the narrowest blocks fill a quarter of the SMs or less (walk_segment_tokens).
    batch_invariant keeps block_v as given and never segments: both follow the batch, and a sequence's bits
    must not."""
    widest = min(block_v, max(16, triton.next_power_of_2(head_v_dim)))
    if batch_invariant:
        return WalkPlan(widest, None, 1)
    narrowest = min(min_block_v, widest)
    sequences = len(lengths)

    def programs(bv: int) -> int:
        return sequences * num_v_heads * triton.cdiv(head_v_dim, bv)

    bv = widest
    while bv > narrowest and programs(bv) < num_sms and programs(bv // 2) <= num_sms:
        bv //= 2
    segment = walk_segment_tokens(lengths, num_v_heads * triton.cdiv(head_v_dim, bv), chunk_size, num_sms)
    if segment is None:
        return WalkPlan(bv, None, 1)
    return WalkPlan(bv, segment, max(1, -(-max(lengths) // segment)))


def walk_segment_tokens(lengths: list[int], programs_per_sequence: int, chunk_size: int, num_sms: int) -> int | None:
    """Segment length (a multiple of chunk_size) that cuts the longest sequence into as many segments as still
    run in one wave of one program per SM, a power of two, each at least MIN_SEGMENT_TOKENS long; or None to
    walk whole sequences: when fewer than MIN_SEGMENTS would do (the sequences fill over a quarter of the
    GPU, or are too short to split).

    A lone 64k-token sequence of 2 value heads of 128 walks as 16 programs in blocks of 16 on an H100's 132
    SMs; in 8 segments of 8k it has 128."""
    programs = len(lengths) * programs_per_sequence
    longest = max(lengths, default=0)
    if programs == 0:
        return None
    pieces = min(_power_of_two_at_most(num_sms // programs), _power_of_two_at_most(longest // MIN_SEGMENT_TOKENS))
    if pieces < MIN_SEGMENTS:
        return None
    return -(-longest // (pieces * chunk_size)) * chunk_size


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclass(frozen=True)
class LaunchTables:
    """int32 device tables of one call: chunk bounds [chunks, 2] (the prep kernel), and per walk launch its
    ranges [rows, 2] (first token, end token) and order [rows] (rows longest first). Whole sequences: one
    walk, `walks["all"]`. Segmented (`pieces` > 1), rows are segment-major (row j * N + n is segment j of
    sequence n): "local" holds segments 0..pieces-2, "transition" segments 1..pieces-1, "all" every one.
    first_chunks[name]: int32 [rows], the index in `chunks` of each row's first chunk (where the split design's
    state walk stores that row's chunk-start states)."""

    chunks: torch.Tensor
    walks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    first_chunks: dict[str, torch.Tensor]


@functools.lru_cache(maxsize=16)
def launch_tables(layout: SequenceLayout, chunk_size: int, segment: int | None, device: torch.device) -> LaunchTables:
    """The tables of a call with this layout (see LaunchTables), sent in one copy that does not wait.

    Cached: every layer of an engine step has the same layout, so the layers after the first build and
    send nothing."""
    bounds = np.asarray(layout.bounds, np.int64)
    starts, ends = bounds[:-1], bounds[1:]
    arrays = [_chunk_bounds(starts, ends, chunk_size)]
    counts = -(-(ends - starts) // chunk_size)
    seq_first_chunk = np.cumsum(counts) - counts
    if segment is None:
        names = ["all"]
        arrays += _ranges_and_order(starts, ends)
        firsts = [seq_first_chunk]
    else:
        pieces = max(1, -(-int((ends - starts).max()) // segment))
        j = np.arange(pieces)[:, None]
        piece_starts = np.minimum(starts[None, :] + j * segment, ends[None, :])   # [pieces, N], segment-major
        piece_ends = np.minimum(piece_starts + segment, ends[None, :])
        names = ["local", "transition", "all"]
        arrays += _ranges_and_order(piece_starts[:-1].ravel(), piece_ends[:-1].ravel())
        arrays += _ranges_and_order(piece_starts[1:].ravel(), piece_ends[1:].ravel())
        arrays += _ranges_and_order(piece_starts.ravel(), piece_ends.ravel())
        # A segment starts at a multiple of chunk_size from its sequence's start (an empty one's index is unused).
        first = seq_first_chunk[None, :] + (piece_starts - starts[None, :]) // chunk_size
        firsts = [first[:-1].ravel(), first[1:].ravel(), first.ravel()]
    sent = upload(arrays + firsts, device)
    walks = {name: (sent[1 + 2 * i], sent[2 + 2 * i]) for i, name in enumerate(names)}
    return LaunchTables(sent[0], walks, dict(zip(names, sent[1 + 2 * len(names):])))


def _chunk_bounds(starts: np.ndarray, ends: np.ndarray, chunk_size: int) -> np.ndarray:
    """[chunks, 2] (first token, end token) of every chunk; chunks never cross a sequence boundary."""
    counts = -(-(ends - starts) // chunk_size)
    first = np.repeat(starts, counts)
    index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    chunk_starts = first + index * chunk_size
    return np.stack([chunk_starts, np.minimum(chunk_starts + chunk_size, np.repeat(ends, counts))], axis=1)


def _ranges_and_order(starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """A walk's ranges [rows, 2] and its rows longest first (ties by row): long walks start first on the GPU."""
    return [np.stack([starts, ends], axis=1), np.argsort(starts - ends, kind="stable")]


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32 copies of `arrays` on `device`, views of one buffer sent in one copy that does not make the host
    wait: from pinned memory, non_blocking (torch's caching host allocator reuses the pinned buffer only once
    the copy has run). Meta tensors for a dry run; host memory when `device` is the CPU (the interpreter)."""
    flat = np.concatenate([np.asarray(a, np.int32).ravel() for a in arrays] or [np.zeros(0, np.int32)])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        buffer = host.pin_memory().to(device, non_blocking=True)
    elif device.type == "meta":
        buffer = torch.empty(flat.shape, dtype=torch.int32, device=device)
    else:
        buffer = host
    out, start = [], 0
    for a in arrays:
        shape = np.shape(a)
        size = int(np.prod(shape))
        out.append(buffer[start:start + size].view(shape))
        start += size
    return out


def chain_segment_starts(local: torch.Tensor, transition: torch.Tensor, initial: torch.Tensor | None,
                         pieces: int, num_sequences: int) -> torch.Tensor:
    """Start states [pieces * N, HV, K, V] (float32, segment-major) of every segment, on the device.

    Over segment j the state evolves affinely, S_end = M_j S_start + A_j: `local` [(pieces - 1) * N, HV, K, V]
    holds A_j for segments 0..pieces-2 (segment 0 walked from the sequence's initial state, so A_0 is its end
    state), `transition` [(pieces - 1) * N, HV, K, K] M_j for segments 1..pieces-1. Then S_start(0) = the
    initial state (zeros when None), S_start(1) = A_0, S_start(j) = A_{j-1} + M_{j-1} S_start(j-1): one batched
    product per segment index over every sequence and head at once, slices only (no host-side indexing, so
    nothing waits for the device)."""
    N, (HV, K, V) = num_sequences, local.shape[1:]
    start = torch.empty(pieces, N, HV, K, V, dtype=torch.float32, device=local.device)
    if initial is None:
        start[0].zero_()
    else:
        start[0].copy_(initial)
    local = local.view(pieces - 1, N * HV, K, V)
    transition = transition.view(pieces - 1, N * HV, K, K)
    flat = start.view(pieces, N * HV, K, V)
    if pieces > 1:
        flat[1].copy_(local[0])
    for j in range(2, pieces):
        torch.baddbmm(local[j - 1], transition[j - 2], flat[j - 1], out=flat[j])
    return start.view(pieces * N, HV, K, V)
