"""How one call's tokens split into sequences and chunks, the checks on the caller's tensors, and how the
Triton kernels see q, k, v (token rows a stride apart, read in place when their layout allows: `token_rows`).

Every implementation sees a call as `N` sequences laid end to end along the token axis: equal-length
batches (`B > 1`, no `cu_seqlens`) become `N = B` sequences of `T` tokens. The small tables the
kernels need (chunk bounds, sequences longest first) are built here on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


_last_read: list = []  # [cu_seqlens tensor, its _version, its values as a tuple]; see from_inputs


@dataclass(frozen=True)
class SequenceLayout:
    """Token offsets of `N` sequences laid end to end: sequence n owns tokens [bounds[n], bounds[n+1])."""

    bounds: tuple[int, ...]

    @classmethod
    def from_inputs(cls, dims: "Dims", cu_seqlens: torch.Tensor | None,
                    cu_seqlens_cpu: torch.Tensor | None = None) -> "SequenceLayout":
        """Host copy of the sequence bounds.

        `cu_seqlens_cpu` (fla's name: the same offsets in host memory, which the caller already has) is read
        instead of `cu_seqlens`, and nothing waits for the device. Without it, reading a GPU tensor syncs the
        device; the engine passes the same cu_seqlens tensor to every layer of a step, so the last GPU one
        read is remembered by identity (and version counter where torch tracks one: not for inference-mode
        tensors, so never write into a cu_seqlens in place).
        """
        B, T = dims.batch, dims.seq_len
        if cu_seqlens is None:
            return cls(tuple(t * T for t in range(B + 1)))
        if cu_seqlens_cpu is not None:
            bounds = tuple(int(x) for x in cu_seqlens_cpu.tolist())
        else:
            version = None if cu_seqlens.is_inference() else cu_seqlens._version
            last = _last_read
            if cu_seqlens.is_cuda and last and last[0] is cu_seqlens and last[1] == version:
                bounds = last[2]
            else:
                bounds = tuple(int(x) for x in cu_seqlens.tolist())
                if cu_seqlens.is_cuda:
                    _last_read[:] = [cu_seqlens, version, bounds]
        if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"cu_seqlens must start at 0, be non-decreasing and end at the token count {T}; "
                f"got [{', '.join(map(str, bounds[:4]))}, ..., {bounds[-1]}]"
            )
        return cls(bounds)

    @property
    def num_sequences(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def longest_first(self) -> list[int]:
        """Sequence indices by decreasing length (ties by index): long walks start first on the GPU."""
        lengths = self.lengths
        return sorted(range(self.num_sequences), key=lambda n: (-lengths[n], n))

    def chunk_bounds(self, chunk_size: int) -> list[tuple[int, int]]:
        """(first token, end token) of every chunk; chunks never cross a sequence boundary."""
        return [
            (t, min(t + chunk_size, end))
            for start, end in zip(self.bounds, self.bounds[1:])
            for t in range(start, end, chunk_size)
        ]


@dataclass(frozen=True)
class Dims:
    """Sizes of one gated-delta-rule call, read from the inputs."""

    batch: int
    seq_len: int
    num_heads: int  # H: query/key heads
    num_v_heads: int  # HV: value heads; value head j reads key head j // (HV // H)
    head_k_dim: int
    head_v_dim: int
    num_sequences: int  # N: B, or len(cu_seqlens) - 1


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    state_indices: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> Dims:
    """Validate shapes, dtypes and devices without reading any tensor's values; return the sizes.

    With state_indices [N] (in-place decode), initial_state is a float32 state pool [slots, HV, K, V].
    cu_seqlens_cpu, given with cu_seqlens, holds the same offsets in host memory (its values are trusted to
    equal cu_seqlens': reading those would make the host wait for the device).

    Raises ValueError naming the offending tensor. (cu_seqlens' values are checked by
    SequenceLayout.from_inputs, which the chunked paths call.)
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T}; got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}; got {tuple(t.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
    devices = {t.device for t in (q, k, v, g, beta)}
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        devices.add(cu_seqlens.device)
        N = cu_seqlens.numel() - 1
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_cpu comes with cu_seqlens: the same offsets, in host memory")
        if (cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape
                or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"cu_seqlens_cpu must be an int32 or int64 CPU tensor shaped like cu_seqlens "
                             f"{tuple(cu_seqlens.shape)}; got {cu_seqlens_cpu.dtype} {tuple(cu_seqlens_cpu.shape)} "
                             f"on {cu_seqlens_cpu.device}")
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices needs initial_state: the state pool its entries index")
        if state_indices.dim() != 1 or state_indices.numel() != N:
            raise ValueError(f"state_indices must have shape [N] = [{N}], got {tuple(state_indices.shape)}")
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
        if (initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, K, V)
                or initial_state.dtype != torch.float32 or not initial_state.is_contiguous()):
            raise ValueError(f"with state_indices, initial_state must be a contiguous float32 state pool "
                             f"[slots, HV, K, V] = [slots, {HV}, {K}, {V}]; got {initial_state.dtype} "
                             f"{tuple(initial_state.shape)}")
        devices.update((state_indices.device, initial_state.device))
    elif initial_state is not None:
        devices.add(initial_state.device)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}; got {tuple(initial_state.shape)}")
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")
    return Dims(B, T, H, HV, K, V, N)


def check_state_indices(state_indices: torch.Tensor, num_slots: int) -> None:
    """Values of in-place state indices (reads them: CPU tensors only): distinct slots in [0, num_slots)."""
    idx = state_indices.tolist()
    if any(not 0 <= i < num_slots for i in idx) or len(set(idx)) != len(idx):
        raise ValueError(f"state_indices must be distinct slots in [0, {num_slots}); got {idx[:8]}...")


# The tile loaders keep a [rows, columns] tile's offsets in int32: rows * row_stride must fit for the largest
# row tile of any kernel (a 128-token chunk).
_MAX_TILE_ROWS = 128


def token_rows(x: torch.Tensor, tokens: int, heads: int, dim: int) -> tuple[torch.Tensor, int]:
    """x ([B, T, heads, dim]) as [tokens, heads, dim] for the Triton kernels, and its token row stride (elements
    between consecutive tokens), read in place when within a token heads then channels are contiguous (a head
    dim elements after the last, a channel 1): the layout of q, k, v as column views of the causal conv's
    output [T, 2 * key_dim + value_dim], which the kernels read where the conv wrote them.

    Any other layout (a batch dim that does not step by T tokens, heads or channels apart, a stride too large
    for the kernels' int32 tile offsets) is copied to a contiguous tensor first: the kernels take one token
    stride and no other."""
    x = x.reshape(tokens, heads, dim)   # a view when the batch dim steps by T tokens, else a copy
    in_place = ((dim == 1 or x.stride(2) == 1) and (heads == 1 or x.stride(1) == dim)
                and x.stride(0) * _MAX_TILE_ROWS < 2**31)
    if not in_place:
        x = x.contiguous()
    return x, (x.stride(0) if tokens > 1 else heads * dim)
